"""store_kv: scatter this step's K/V rows into the paged cache (Triton).

Cache layout, per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
A token's row (all kv heads of one position) is contiguous, so one program writes one token with
a single [num_kv_heads, head_dim] store; padded tokens (slot -1) exit before touching memory.

A quantized cache (kernels/kv_quant.py) takes fp32 scales [num_blocks, block_size, num_kv_heads]:
fp8 (QUANT = 1) divides by the slot's static scale and saturates to +-448 before the cast;
int8 (QUANT = 2) computes each head's scale max|x| / 127, stores it, and rounds x / scale.
"""

import torch
import triton
import triton.language as tl

from kernels import kv_quant


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_cache_b, stride_cache_s, stride_cache_h,
    stride_scale_b, stride_scale_s, stride_scale_h,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
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
    if QUANT == 0:
        tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        scale_off = block_id * stride_scale_b + offset * stride_scale_s + offs_h * stride_scale_h
        _store_quantized(k.to(tl.float32), k_cache_ptr + cache_off, k_scale_ptr + scale_off,
                         mask, offs_h < num_kv_heads, QUANT)
        _store_quantized(v.to(tl.float32), v_cache_ptr + cache_off, v_scale_ptr + scale_off,
                         mask, offs_h < num_kv_heads, QUANT)


@triton.jit
def _store_quantized(x, cache_ptrs, scale_ptrs, mask, head_mask, QUANT: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] fp32 -> codes at cache_ptrs; scales [BLOCK_H] read (fp8, static)
    or written (int8, max|x| / 127 per head)."""
    if QUANT == 1:
        scale = tl.load(scale_ptrs, mask=head_mask, other=1.0)
        codes = tl.clamp(x / scale[:, None], -448.0, 448.0)
    else:
        scale = tl.max(tl.abs(x), axis=1) / 127.0  # masked columns loaded as 0
        tl.store(scale_ptrs, scale, mask=head_mask)
        safe = tl.where(scale > 0.0, scale, 1.0)
        y = x / safe[:, None]
        # Rounded half to even, as torch.round in the twin.
        codes = tl.clamp(_rint(y), -127.0, 127.0)
    tl.store(cache_ptrs, codes.to(cache_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rint(y):
    """Round to nearest, ties to even, in fp32 (what torch.round does): adding and
    subtracting 1.5 * 2^23 leaves the integer part rounded by the FPU's own mode; exact for
    |y| < 2^22, which int8's codes (|y| <= 127) are."""
    magic = 12582912.0  # 1.5 * 2^23
    return (y + magic) - magic


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None,  # (quantized caches: kernels/kv_quant.py)
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, "key and value shapes differ"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "cache heads/head_dim mismatch"
    assert slot_mapping.shape == (num_tokens,), "slot_mapping must be [num_tokens]"
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == 1, (
        "head_dim must be contiguous"
    )
    quant = 0
    if kv_quant.is_quantized(k_cache.dtype):
        quant = 2 if kv_quant.dynamic_scales(k_cache.dtype) else 1
        assert k_scale is not None and v_scale is not None, "a quantized cache needs its scales"
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3]
        assert k_scale.stride() == v_scale.stride() and k_scale.dtype == torch.float32
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if quant else key, v_scale if quant else value,  # never read unquantized
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *(k_scale.stride() if quant else (0, 0, 0)),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=quant,
    )  # fmt: skip
