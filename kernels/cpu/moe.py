"""The CPU backend's mixture-of-experts MLP: experts packed once into the fused kernel's slabs
(kernels/csrc/fused_moe.cpp) and the torch grouped path (kernels/grouped_moe.py); the torch
twin (kernels/twins.py fused_moe) is the oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import twins
from kernels.cpu.runtime import compute_dtype, fused_kernels
from kernels.grouped_moe import grouped_moe

# Mixture of experts. A model's experts are packed once at load (`pack_moe_weights`) into the
# fused kernel's slabs (kernels/csrc/fused_moe.cpp), which replace the plain weights. Steps run
# the fused kernel: it streams each touched expert's slabs once per step, its rows re-read from
# cache. With native bf16 matmuls (oneDNN's bf16 dot products do twice the arithmetic per
# instruction of the kernel's fp32 FMAs) only while the experts average at most
# FUSED_MOE_BF16_PAIRS (token, slot) pairs each; past that (long prefill chunks) the torch
# grouped path, one matmul per touched expert and projection on the expert unpacked from its
# slabs. Measured on the 2-core AVX512-BF16 EPYC (bench/results/2026-11-28-cpu-fused-moe-packed.md):
# the kernel 3-9x the grouped path up to 64 pairs per expert in both dtypes; bf16 1.6x at 64
# pairs per expert, even at 128, 0.8x at 256.
FUSED_MOE_BF16_PAIRS = 128
MOE_PACK = 16  # features per slab


def _fused_moe_takes(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> bool:
    return (compute_dtype(dtype) == torch.float32
            or num_tokens * top_k <= FUSED_MOE_BF16_PAIRS * num_experts)


_MOE_ACTIVATION_IDS = {"silu": 0, "swigluoai": 1}
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PackedExperts:
    """Every expert's weights in the fused kernel's slabs (kernels/csrc/fused_moe.cpp):
    w13 [E, 2 * ceil(I / 16), H, 16] (per block of 16 intermediate features its gate slab, then
    its up slab; zero past I), w2 [E, ceil(H / 16), I, 16]."""

    w13: torch.Tensor
    w2: torch.Tensor
    intermediate: int

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `e`'s plain weights, copies: w13 [2I, H] (gate rows, then up), w2 [H, I]."""
        i, h = self.intermediate, self.hidden
        blocks = self.w13.shape[1] // 2
        w13 = self.w13[e].view(blocks, 2, h, MOE_PACK).permute(1, 0, 3, 2)  # [2, nb, 16, H]
        w13 = w13.reshape(2, blocks * MOE_PACK, h)[:, :i].reshape(2 * i, h)
        w2 = self.w2[e].transpose(1, 2).reshape(-1, i)[:h]
        return w13, w2


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts:
    """w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I] -> their slabs (`PackedExperts`),
    written expert by expert: no transient copy larger than one expert."""
    e, two_i, h = w13.shape
    i = two_i // 2
    blocks, hblocks = -(-i // MOE_PACK), -(-h // MOE_PACK)
    packed13 = w13.new_zeros((e, blocks, 2, h, MOE_PACK))
    packed2 = w2.new_zeros((e, hblocks, i, MOE_PACK))
    for expert in range(e):
        for part in range(2):  # gate rows, then up rows: [I, H] -> [nb, H, 16]
            rows = w13[expert, part * i:(part + 1) * i]
            full = rows.new_zeros((blocks * MOE_PACK, h))
            full[:i] = rows
            packed13[expert, :, part] = full.view(blocks, MOE_PACK, h).transpose(1, 2)
        full = w2.new_zeros((hblocks * MOE_PACK, i))
        full[:h] = w2[expert]
        packed2[expert] = full.view(hblocks, MOE_PACK, i).transpose(1, 2)
    return PackedExperts(packed13.view(e, 2 * blocks, h, MOE_PACK), packed2, i)


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    *,
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    activation: str = "silu",
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
) -> torch.Tensor:  # [num_tokens, hidden] in x's dtype
    """twins.fused_moe on plain weights, reading only the experts the step touches: the torch
    grouped path. Models pack their experts at load and call `fused_moe_packed`."""
    assert activation in twins.MOE_ACTIVATIONS, f"activation is one of {twins.MOE_ACTIVATIONS}"
    return _fused_moe_grouped(x, lambda e: (w13[e], w2[e]), w13.shape[0], topk_weights,
                              topk_ids, w13_bias, w2_bias, activation, swiglu_limit,
                              swiglu_alpha)


def fused_moe_packed(x: torch.Tensor, packed: PackedExperts, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None, activation: str = "silu",
                     swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702) -> torch.Tensor:
    """`fused_moe` on packed experts: the fused kernel (bf16 with native matmuls: up to
    FUSED_MOE_BF16_PAIRS pairs per expert on average), pairs sorted by expert, each touched
    expert's slabs streamed once, the activation fused, fp32 throughout, the weighted sum over
    a token's slots in slot order; batch and thread invariant. Otherwise, or without the
    extension, the torch grouped path on the touched experts unpacked."""
    assert activation in twins.MOE_ACTIVATIONS, f"activation is one of {twins.MOE_ACTIVATIONS}"
    ops = fused_kernels()
    dtype = x.dtype
    if (ops is not None and x.stride(-1) == 1
            and _fused_moe_takes(x.shape[0], topk_ids.shape[1], packed.num_experts, dtype)
            and packed.w13.dtype == dtype and dtype in _FUSED_DTYPES
            and all(b is None or (b.dtype == dtype and b.is_contiguous())
                    for b in (w13_bias, w2_bias))):
        return ops.fused_moe_packed(x, packed.w13, packed.w2, topk_weights.float().contiguous(),
                                    topk_ids.long().contiguous(), w13_bias, w2_bias,
                                    _MOE_ACTIVATION_IDS[activation], swiglu_limit, swiglu_alpha,
                                    packed.intermediate)
    return _fused_moe_grouped(x, packed.expert, packed.num_experts, topk_weights, topk_ids,
                              w13_bias, w2_bias, activation, swiglu_limit, swiglu_alpha)


def _fused_moe_grouped(x, expert_weights, num_experts, topk_weights, topk_ids, w13_bias,
                       w2_bias, activation, swiglu_limit, swiglu_alpha) -> torch.Tensor:
    """kernels/grouped_moe.py with each touched expert (`expert_weights(e)`: its w13 [2I, H]
    and w2 [H, I]) as one matmul per projection on its run of rows, in `compute_dtype` (fp32
    activation). The matmuls' blocking depends on how many rows an expert gets, so unlike the
    fused kernel this path is not batch invariant to the bit."""
    cdt = compute_dtype(x.dtype)

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        w13, w2 = expert_weights(expert)
        b13 = w13_bias[expert].to(cdt) if w13_bias is not None else None
        h = F.linear(rows.to(cdt), w13.to(cdt), b13).float()  # [n, 2 * intermediate]
        a = twins.moe_activation(h, activation, swiglu_limit, swiglu_alpha).to(cdt)
        b2 = w2_bias[expert].to(cdt) if w2_bias is not None else None
        return F.linear(a, w2.to(cdt), b2)

    return grouped_moe(x, topk_weights, topk_ids, num_experts, expert_mlp)
