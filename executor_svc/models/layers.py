"""Building blocks shared by the decoder families: RMSNorm and the gated MLP (linears live in
linear.py, their tensor-parallel forms in parallel.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.models.parallel import MergedColumnParallelLinear, RowParallelLinear
from kernels import rms_norm, silu_and_mul


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # Without residual: normed x. With residual: (normed(x + residual), x + residual).
        return rms_norm(x, self.weight, self.eps, residual)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul; act is SiLU
    (SwiGLU, the fused silu_and_mul kernel) or GELU with the tanh approximation (GeGLU, HF's
    gelu_pytorch_tanh). Tensor parallel: each rank holds intermediate_size / tp of gate and
    of up (the activation pairs them within the rank) and the matching columns of down, whose
    partial sums are reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype,
                 activation: str = "silu"):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       bias, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, dtype)
        assert activation in ("silu", "gelu_pytorch_tanh"), activation
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate / tp]
        if self.activation == "silu":
            return self.down_proj(silu_and_mul(gate_up))  # [num_tokens, hidden]
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)  # [num_tokens, hidden]
