"""store_kv: scatter this step's K/V rows into the paged cache (Triton).

Cache layout, per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
A token's row (all kv heads of one position) is contiguous, so one program writes one token with
a single [num_kv_heads, head_dim] store; padded tokens (slot -1) exit before touching memory.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_cache_b, stride_cache_s, stride_cache_h,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    cache_off = block_id * stride_cache_b + offset * stride_cache_s
    cache_off += offs_h[:, None] * stride_cache_h + offs_d[None, :]  # [BLOCK_H, BLOCK_D]
    key_off = token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :]
    value_off = token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :]
    k = tl.load(key_ptr + key_off, mask=mask)
    v = tl.load(value_ptr + value_off, mask=mask)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, "key and value shapes differ"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "cache heads/head_dim mismatch"
    assert slot_mapping.shape == (num_tokens,), "slot_mapping must be [num_tokens]"
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == 1, (
        "head_dim must be contiguous"
    )
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
