"""Merge of split-KV partial attention outputs (Triton).

Each split s of a query row left a normalized partial output o_s and lse_s = log2(sum of its
exp2 scores). The merged row is sum_s w_s * o_s with w_s = exp2(lse_s - max lse) / sum of those
weights; empty splits carry lse = -inf and weigh nothing and their partial outputs are never read (an
unused split writes only its lse). Every real query sees at least its own key, which lies in one
of its tile's splits, so the max is finite for every real query.

Attention sinks (one logit per q head, natural-log units) join the merge: the sink's exp2 weight
exp2(sink * log2 e - max lse) adds to the sum of weights, i.e. the merged lse plus the sink is the
softmax's denominator, and the sink's own share of the output is dropped.
"""

import math

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(math.log2(math.e))


# Per-step values are never specialized on, and the splits are walked in blocks of
# SPLITS_BLOCK by a loop to num_splits: one compile serves every split count.
@triton.jit(do_not_specialize=["stride_p_t", "stride_p_h", "stride_p_s", "stride_lse_t",
                               "stride_lse_h", "num_splits"])
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, sinks_ptr,
    stride_p_t, stride_p_h, stride_p_s, stride_lse_t, stride_lse_h, stride_out_t, stride_out_h,
    num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_BLOCK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    lse_row = lse_ptr + token * stride_lse_t + head * stride_lse_h
    partial_row = partial_ptr + token * stride_p_t + head * stride_p_h
    lse_max = tl.full([SPLITS_BLOCK], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, SPLITS_BLOCK):
        lse = tl.load(lse_row + s0 + offs_s, mask=s0 + offs_s < num_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    # A row with no key at all (a padded entry of a captured batch) gets zeros, not NaN.
    top = tl.max(lse_max, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([SPLITS_BLOCK], tl.float32)
    merged = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for s0 in range(0, num_splits, SPLITS_BLOCK):
        splits = s0 + offs_s
        lse = tl.load(lse_row + splits, mask=splits < num_splits, other=float("-inf"))
        weights = tl.math.exp2(lse - shift)  # 0 for empty splits
        total += weights
        mask = (lse > float("-inf"))[:, None] & (offs_d[None, :] < HEAD_DIM)
        partial = tl.load(partial_row + splits[:, None] * stride_p_s + offs_d[None, :], mask=mask,
                          other=0.0)  # [SPLITS_BLOCK, HEAD_DIM_PAD]
        merged += tl.sum(partial * weights[:, None], 0)
    norm = tl.sum(total, 0)
    if HAS_SINKS:  # in the denominator only; a row with no key still gets zeros (merged = 0)
        norm += tl.math.exp2(tl.load(sinks_ptr + head).to(tl.float32) * LOG2E - shift)
    merged = merged / tl.where(norm == 0.0, 1.0, norm)
    out_off = token * stride_out_t + head * stride_out_h + offs_d
    tl.store(out_ptr + out_off, merged.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


SPLITS_BLOCK = 16


def merge_splits(
    partial: torch.Tensor,  # [num_tokens, num_heads, num_splits, head_dim] fp32 (strided view)
    lse: torch.Tensor,  # [num_tokens, num_heads, num_splits] fp32, base 2 (strided view)
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    sinks: torch.Tensor | None = None,  # [num_heads] float, natural-log units
) -> None:
    num_tokens, num_heads, num_splits, head_dim = partial.shape
    assert lse.shape == partial.shape[:3] and lse.stride(-1) == 1 and partial.stride(-1) == 1
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.stride(0) == 1)
    _merge_splits_kernel[(num_tokens, num_heads)](
        partial, lse, out, lse if sinks is None else sinks,  # never read without sinks
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        SPLITS_BLOCK=SPLITS_BLOCK, HAS_SINKS=sinks is not None,
    )  # fmt: skip
