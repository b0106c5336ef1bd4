"""What this CPU offers the backend: native bf16 matmuls, and the fused C++ kernels
(kernels/cpu_ext.py) when they are built and enabled."""

from __future__ import annotations

import functools

import torch

from kernels import cpu_ext


@functools.cache
def has_native_bf16() -> bool:
    """True where oneDNN runs bf16 matmuls natively (AVX512-BF16, AMX, AVX-NE-CONVERT), and
    torch's ISA is not forced below the CPU's: with ATEN_CPU_CAPABILITY=avx2 an AVX-512 machine
    takes the path of an AVX2-only one (kernels/cpu_ext.py)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and not cpu_ext.lowered()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in for tensors of `dtype` on this CPU."""
    if dtype == torch.bfloat16 and has_native_bf16():
        return dtype
    return torch.float32


def fused_kernels():
    """torch.ops.folio_cpu when the fused CPU kernels are built and enabled, else None."""
    return cpu_ext.load()
