"""Linear layers and the seam that decides how their weights are stored and multiplied.

Every projection (and the LM head) is a `Linear` whose forward is ``self.method.apply(self,
x, self.bias)``; the bias is an argument so a row-parallel layer (models/parallel.py) can add
its bias once, after the ranks' partial products are summed. Layers are built with `DENSE` (plain ``F.linear``); once the checkpoint is loaded,
`use_linear_method` (called by the loader) gives every layer the method that suits the device
and lets it rearrange the weights (``process_weights``). Quantized weights plug in here:
executor_svc/quantization's methods keep 8-bit weights and their scales and multiply them.

CPU methods, chosen by measurement (bench/cpu_step.py; docs/benchmarks.md has the tables):

- fp32: two pre-packed forms of each weight (`PackedCpuLinear`): 16-feature slabs for the
  fused skinny kernel (kernels/csrc/skinny_linear.cpp), which takes decode batches up to 64
  rows (1.43x oneDNN at one row, 1.07x at 32: it streams the weights at ~44 GB/s on the 2-core
  machine), and oneDNN's blocked layout for more rows (1.2-2.7x ``F.linear`` from 2 to 256
  rows, equal from 512). The plain weight is then released, so the linear weights take twice
  their size; a tied LM head keeps it (the embedding looks rows up in it). Both products
  differ from ``F.linear`` by float rounding only (about 1e-6 relative); greedy decoding stays
  token-exact against transformers (tests/e2e). Without the fused kernels, oneDNN's layout
  for one row replaces the slabs (one-row steps only).
- bf16 on a CPU without native bf16 matmuls (no AVX512-BF16/AMX): torch's emulated bf16 gemm
  is 3x slower than fp32 from 16 rows up; `UpcastCpuLinear` keeps the bf16 weight (half the
  memory and bandwidth) and multiplies in fp32 one cache-sized slice of rows at a time. One
  row stays a bf16 gemv, which is memory bound and faster than fp32.
- bf16 with native support (AVX512-BF16, AMX): `PackedCpuLinear` as for fp32, the skinny
  kernel up to 2 rows and oneDNN's bf16 and AMX kernels above (their native dot products beat
  the kernel's fp32 FMAs from 4 rows). Against ``F.linear`` on a 2-core Xeon with
  AMX (Qwen2.5-0.5B's shapes; best of 15 interleaved runs): 1.4-2.4x faster at one row (the
  LM head 35 vs 50 ms), 1.4x at 16-128 rows, 2.3x at 512.
"""

from __future__ import annotations

from typing import Protocol

import structlog
import torch
import torch.nn.functional as F
from torch import nn

import kernels.cpu

log = structlog.get_logger(__name__)


class LinearMethod(Protocol):
    def process_weights(self, layer: Linear) -> None:
        """Called once after the weights are loaded; may attach prepared forms to `layer`."""

    def apply(self, layer: Linear, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features], plus `bias` when given
        (the layer's own, or None: the caller adds it later)."""


class DenseLinear:
    def process_weights(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


DENSE = DenseLinear()


class Linear(nn.Linear):
    """nn.Linear whose product is computed by its `method` (see the module docstring)."""

    method: LinearMethod = DENSE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class PackedCpuLinear:
    """fp32, or bf16 on a CPU with native bf16: two pre-packed forms of the weight, one for few
    rows and one for many. Few rows (decode batches up to `skinny_max_rows`): the fused
    kernel's slabs (``skinny_weight``, kernels/csrc/skinny_linear.cpp), or where the fused
    kernels are not built oneDNN's layout for one row (``gemv_weight``, one row only). More
    rows: oneDNN's layout for many (``packed_weight``). Invariant after process_weights: both
    forms hold the matrix ``layer.weight`` held; with `release_plain`, ``layer.weight`` of a
    `Linear` is then empty (a `TiedHead` keeps it: it is the embedding)."""

    def __init__(self, release_plain: bool = True):
        self.release_plain = release_plain
        self.ops = kernels.cpu.fused_kernels()

    def process_weights(self, layer: Linear) -> None:
        weight = layer.weight.detach()
        if weight.numel() == 0:
            raise ValueError("PackedCpuLinear: this layer's plain weight was already released")
        if self.ops is not None:
            layer.skinny_weight = pack_skinny_weight(weight)
            layer.skinny_out_features = weight.shape[0]
            layer.skinny_max_rows = SKINNY_MAX_ROWS.get(weight.dtype, 0)
        else:
            # The second argument is the batch size oneDNN picks its blocking for; the packed
            # weight serves any row count.
            layer.gemv_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        if self.release_plain and isinstance(layer, Linear):
            layer.weight.data = torch.empty(0, dtype=weight.dtype)

    def apply(self, layer: Linear, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if self.ops is not None:
            if rows <= layer.skinny_max_rows:
                return self.ops.skinny_linear(x, layer.skinny_weight, bias,
                                              layer.skinny_out_features)
            packed = layer.packed_weight
        else:
            packed = layer.gemv_weight if rows == 1 else layer.packed_weight
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Rows up to which the skinny kernel beats oneDNN's packed layouts, every linear of a model
# streamed once per step (weights cold), 2 threads, AMD EPYC with AVX512-BF16. SmolLM2's: fp32
# 1.43x at 1 row, 1.10x at 8, 1.07x at 32, 1.02x at 64, 0.98x at 128; bf16 1.10x at 1, 1.03x at
# 4, 0.96x at 8. Qwen2.5-0.5B's, bf16: 1.16x at 1, 0.99x at 2, 0.95x at 4 (oneDNN's bf16 dot
# products do twice the arithmetic per instruction of the kernel's fp32 FMAs).
SKINNY_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 2}


def pack_skinny_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16], zero past N: the skinny kernel's slabs."""
    n, k = weight.shape
    blocks = -(-n // 16)
    padded = torch.zeros(blocks * 16, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(blocks, 16, k).transpose(1, 2).contiguous()


class UpcastCpuLinear:
    """bf16 weights on a CPU without native bf16 matmuls: fp32 products on slices of at most
    `chunk_elems` weight elements, upcast into one reused scratch buffer (so the upcast copy
    stays in cache and no large temporary is allocated per call)."""

    def __init__(self, chunk_elems: int = 1 << 19, gemv_rows: int = 1):
        self.chunk_elems, self.gemv_rows = chunk_elems, gemv_rows
        self._scratch = torch.empty(0, dtype=torch.float32)  # [chunk_elems] at most

    def process_weights(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= self.gemv_rows:
            return F.linear(x, layer.weight, bias)
        weight = layer.weight  # [out_features, in_features] bf16
        out_features, in_features = weight.shape
        rows = max(1, self.chunk_elems // in_features)
        if self._scratch.numel() < rows * in_features:
            self._scratch = torch.empty(rows * in_features, dtype=torch.float32)
        xf = x.float()  # [num_tokens, in_features]
        out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
        for start in range(0, out_features, rows):
            end = min(start + rows, out_features)
            w = self._scratch[:(end - start) * in_features].view(end - start, in_features)
            w.copy_(weight[start:end])
            out[:, start:end] = xf @ w.t()
        if bias is not None:
            out += bias
        return out.to(x.dtype)


class TiedHead:
    """The LM head of a model with tied embeddings: the embedding matrix used as a `Linear`.
    A plain object, not a module, so the matrix stays one parameter (the embedding's)."""

    bias = None

    def __init__(self, embedding: nn.Embedding):
        self.embedding = embedding
        self.method: LinearMethod = DENSE

    @property
    def weight(self) -> torch.Tensor:  # [vocab_size, hidden_size]
        return self.embedding.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, None)  # type: ignore[arg-type]


def cpu_linear_method(dtype: torch.dtype, native_bf16: bool,
                      keep_plain_weights: bool = False) -> LinearMethod:
    if dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16):
        return PackedCpuLinear(release_plain=not keep_plain_weights)
    if dtype == torch.bfloat16:
        return UpcastCpuLinear()
    return DENSE


def use_linear_method(model: nn.Module, method: LinearMethod) -> int:
    """Give every `Linear` in `model` (and its `lm_head` when that is a `TiedHead`) the method
    and let it prepare the weights; returns how many layers it took. A layer (or tied head)
    whose method holds quantized weights (``method.quantized``, executor_svc/quantization)
    keeps it: its plain weight is gone (a tied head's embedding holds GGUF blocks)."""
    layers: list = [m for m in model.modules() if isinstance(m, Linear)]
    if isinstance(getattr(model, "lm_head", None), TiedHead):
        layers.append(model.lm_head)
    layers = [m for m in layers if not getattr(m.method, "quantized", False)]
    for layer in layers:
        layer.method = method
        method.process_weights(layer)
    return len(layers)
