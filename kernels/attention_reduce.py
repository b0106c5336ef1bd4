"""Merge of split-KV partial attention outputs (Triton).

Each split s of a query row left a normalized partial output o_s and lse_s = log2(sum of its
exp2 scores). The merged row is sum_s w_s * o_s with w_s = exp2(lse_s - max lse) / sum of those
weights; empty splits carry lse = -inf and weigh nothing and their partial outputs are never read (an
unused split writes only its lse). Split 0 always holds key 0, which every query sees, so the
max is finite for every real query.
"""

import torch
import triton
import triton.language as tl


# Per-step values are never specialized on, so the merge never recompiles per step.
@triton.jit(do_not_specialize=["stride_p_t", "stride_p_h", "stride_p_s", "stride_lse_t",
                               "stride_lse_h", "num_splits"])
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr,
    stride_p_t, stride_p_h, stride_p_s, stride_lse_t, stride_lse_h, stride_out_t, stride_out_h,
    num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    lse = tl.load(
        lse_ptr + token * stride_lse_t + head * stride_lse_h + offs_s,
        mask=s_mask,
        other=float("-inf"),
    )  # [SPLITS_PAD]
    # A row with no key at all (a padded entry of a captured batch) gets zeros, not NaN.
    lse_max = tl.max(lse, 0)
    weights = tl.math.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    total = tl.sum(weights, 0)
    weights = weights / tl.where(total == 0.0, 1.0, total)
    mask = (lse > float("-inf"))[:, None] & (offs_d[None, :] < HEAD_DIM)
    partial_off = token * stride_p_t + head * stride_p_h
    partial_off += offs_s[:, None] * stride_p_s + offs_d[None, :]  # [SPLITS_PAD, HEAD_DIM_PAD]
    partial = tl.load(partial_ptr + partial_off, mask=mask, other=0.0)
    merged = tl.sum(partial * weights[:, None], 0)  # [HEAD_DIM_PAD]
    out_off = token * stride_out_t + head * stride_out_h + offs_d
    tl.store(out_ptr + out_off, merged.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def merge_splits(
    partial: torch.Tensor,  # [num_tokens, num_heads, num_splits, head_dim] fp32 (strided view)
    lse: torch.Tensor,  # [num_tokens, num_heads, num_splits] fp32, base 2 (strided view)
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    num_tokens, num_heads, num_splits, head_dim = partial.shape
    assert lse.shape == partial.shape[:3] and lse.stride(-1) == 1 and partial.stride(-1) == 1
    _merge_splits_kernel[(num_tokens, num_heads)](
        partial, lse, out,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )  # fmt: skip
