"""The Triton launchers under the public names; imported lazily by kernels/__init__.py.

Importing this module imports triton and decorates every kernel, so TRITON_INTERPRET must be
set (or not) before the first import.
"""

from kernels.activation import silu_and_mul
from kernels.attention import paged_attention
from kernels.grouped_linear import group_quant_linear
from kernels.kv_cache import store_kv
from kernels.moe import fused_moe
from kernels.norm import rms_norm
from kernels.quant_linear import w8a16_linear
from kernels.rope import rotary

__all__ = ["fused_moe", "group_quant_linear", "paged_attention", "rms_norm", "rotary", "silu_and_mul", "store_kv", "w8a16_linear"]
