"""Building blocks shared by the decoder families: RMSNorm and the gated MLP (linears live in
linear.py)."""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.models.linear import Linear, MergedLinear
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
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]
        return self.down_proj(silu_and_mul(gate_up))  # [num_tokens, hidden]
