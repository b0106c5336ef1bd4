"""rotary: neox-style rotary embedding, in place on q and k (Triton).

The cos/sin cache [max_position, head_dim] holds cos in the first head_dim // 2 columns and sin in
the last, so any scaling scheme (llama3, linear, ...) is a different cache built by the model and
the same kernel. One program rotates every head of one token, q and k, so a position's cos/sin
row is read once.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, num_heads, cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < half)
    ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]  # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + half, mask=mask, other=0.0)
    # cos/sin are rounded to the activation dtype first, as transformers does.
    c = cos.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    s = sin.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(ptr1, (x1f * c - x2f * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + half, (x2f * c + x1f * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cache,
    num_heads, num_kv_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cache + offs_d, mask=offs_d < half, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + half + offs_d, mask=offs_d < half, other=0.0)
    _rotate_heads(
        q_ptr + token * stride_q_t, stride_q_h, num_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr + token * stride_k_t, stride_k_h, num_kv_heads, cos, sin, half, BLOCK_HK, BLOCK_HALF
    )


def rotary(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and positions.shape == (num_tokens,)
    assert cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0, (
        "cache must be [max_pos, head_dim]"
    )
    assert q.stride(-1) == k.stride(-1) == cos_sin_cache.stride(-1) == 1, (
        "head_dim must be contiguous"
    )
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_heads, num_kv_heads, half,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )  # fmt: skip
