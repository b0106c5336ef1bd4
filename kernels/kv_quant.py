"""The quantized KV cache's one definition: its dtypes, its scales, quantize and dequantize.

`--kv-cache-dtype` (vLLM's names): `auto` keeps K/V in the model's dtype; `fp8` (= `fp8_e4m3`)
stores float8 e4m3fn, `int8` stores int8. A stored element is dequantized as

    value = float(code) * scale[block, offset, kv_head]        (fp32)

so every kernel takes the scales as one fp32 tensor per cache, `[num_blocks, block_size,
num_kv_heads]` with any strides, beside `[num_blocks, block_size, num_kv_heads, head_dim]`:

- fp8: **static** scales, one per (layer, KV head): a checkpoint's `k_scale`/`v_scale` (per
  tensor or per head, llm-compressor/vLLM's convention: value = code * scale), else 1.0 (what
  vLLM assumes: e4m3's range, +-448, holds every K/V element of the models we serve, and its
  relative step, 2^-4, is what is lost). The kernels get a stride-0 view of the per-head
  vector; `store_kv` reads it: code = saturate(x / scale) rounded to e4m3.
- int8: **dynamic** scales, one per (position, KV head), stored beside the cache in fp32 and
  written by `store_kv`: scale = max|x| / 127 over the head's row, code = round(x / scale),
  so every row uses the full int8 range whatever the layer's magnitudes, with no calibration
  (absolute error at most scale / 2 per element). The scales cost 4 bytes per head row
  (`bytes_per_element`), so int8 holds slightly fewer blocks than fp8.

The twins, the CPU backend's torch paths and `quantize_rows` here share these formulas exactly;
the Triton store rounds the same formula (a division on the device may differ by one ulp, so a
code by one step at a rounding tie), the C++ and Triton attention kernels widen on load.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
FP8_MAX = 448.0  # largest finite float8 e4m3fn
INT8_MAX = 127.0  # codes -127..127: symmetric, -128 unused
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a --kv-cache-dtype name; ValueError for an unknown name."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if name == "int8":
        return torch.int8
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                     f"not {name!r}")


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def dynamic_scales(dtype: torch.dtype) -> bool:
    """Whether store_kv writes the scales (int8: per position and head) rather than reading
    them (fp8: static per head)."""
    return dtype == torch.int8


def bytes_per_element(dtype: torch.dtype, head_dim: int) -> float:
    """Cache bytes per K (or V) element, the int8 scales included."""
    elem = torch.empty((), dtype=dtype).element_size()
    return elem + (4 / head_dim if dynamic_scales(dtype) else 0)


def static_scale_view(per_head: torch.Tensor,  # [num_kv_heads] fp32
                      num_blocks: int, block_size: int) -> torch.Tensor:
    """The kernels' scale operand for static scales: [num_blocks, block_size, num_kv_heads],
    stride 0 over blocks and offsets."""
    return per_head.float().view(1, 1, -1).expand(num_blocks, block_size, per_head.numel())


def quantize_rows(x: torch.Tensor,  # [n, num_kv_heads, head_dim], any float dtype
                  dtype: torch.dtype,
                  scale: torch.Tensor | None = None,  # [n, num_kv_heads] fp32: fp8's static
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # codes [n, H, D], scale [n, H]
    """Codes of `dtype` and their scales. fp8: x / scale saturated to +-448 and rounded to
    nearest even; int8: scale = max|x| / 127 per row (0 for a zero row), codes round(x / scale)."""
    xf = x.float()
    if dtype == torch.float8_e4m3fn:
        assert scale is not None, "fp8 KV needs its static scales"
        codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(dtype)
        return codes, scale
    assert dtype == torch.int8, f"not a quantized KV dtype: {dtype}"
    amax = xf.abs().amax(dim=-1)  # [n, H]
    scale = amax / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xf / safe[..., None]).clamp(-INT8_MAX, INT8_MAX).to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor,  # [..., head_dim] fp8 or int8
               scale: torch.Tensor,  # [...] fp32
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scale.float()[..., None]).to(dtype)
