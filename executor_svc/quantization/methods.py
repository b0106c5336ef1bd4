"""Weight-only 8-bit linear methods (models/linear.py's `LinearMethod`): int8 and fp8 e4m3.

Invariant after ``process_weights(layer)``: ``layer.qweight`` [N, K] (int8 or float8_e4m3fn)
and ``layer.qscale`` [N] fp32 hold the layer's matrix as ``qweight.float() * qscale[:, None]``
(the dequantized weight, exactly what a float reference model is given); the plain weight and
any checkpoint scale are released (empty), so the layer holds N*K bytes plus 4*N. ``apply``
is ``kernels.w8a16_linear``: the Triton kernel on CUDA (upcast in the kernel), the torch twin
on the CPU (cache-sized dequantized slices, never a full float copy); on the CPU backend with
the fused kernels built, both schemes instead keep the matrix in 16-feature slabs (``q8_slabs``
/ ``f8_slabs``, ``qweight`` then empty; `quantized_weight` unpacks either) and run the fused
skinny kernels.

Quantized at load (from float weights): symmetric, one scale per output channel, scale =
absmax / qmax (127 for int8, 448 for e4m3), int8 rounded to nearest, e4m3 by torch's cast
(round to nearest even). A row-parallel layer's rank holds only some columns of each row, so
its absmax is reduced (max) over the ranks: every rank then holds exactly the slice of the
matrix one rank would, and tensor parallelism does not change the quantized model.

From an fp8 checkpoint: the weight is kept as loaded and its scale (per tensor, one per fused
shard, or per channel) is expanded to one fp32 scale per output row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import kernels
import kernels.cpu
from checkpoints.quant_config import QuantConfig
from executor_svc.models.linear import Linear, pack_skinny_weight
from executor_svc.models.parallel import RowParallelLinear
from executor_svc.quantization.gguf_loading import GgufWeights
from executor_svc.quantization.gptq import AwqWeights, GptqWeights
from kernels import cpu_quant

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


class WeightOnly8Bit:
    """Shared by both schemes; `weight_dtype` and `qmax` make the difference."""

    quantized = True  # use_linear_method leaves a layer with this method alone
    weight_dtype: torch.dtype
    qmax: float

    def holds(self, layer: Linear) -> bool:
        """Whether the checkpoint stores this layer in the scheme's form."""
        return layer.weight.dtype == self.weight_dtype

    def process_weights(self, layer: Linear) -> None:
        weight = layer.weight.detach()  # [N, K]
        if weight.numel() == 0:
            raise ValueError(f"{type(self).__name__}: the layer's plain weight was released")
        if weight.dtype == self.weight_dtype:  # as the checkpoint stored it
            layer.qweight = weight
            layer.qscale = per_row_scale(layer)
            layer.weight_scale.data = torch.empty(0, device=weight.device)
        else:
            layer.qweight, layer.qscale = self.quantize(weight, _reduce_over_ranks(layer))
        layer.weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def quantize(self, weight: torch.Tensor,
                 reduce_max=None) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, K] float -> (qweight [N, K], scale [N] fp32). `reduce_max` turns this rank's
        per-row absmax into the whole row's (row-parallel layers)."""
        w = weight.float()
        absmax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])  # [N]
        if reduce_max is not None:
            absmax = reduce_max(absmax)
        scale = absmax / self.qmax
        # An all-zero row quantizes to zeros whatever its scale; avoid 0 / 0.
        q = w / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        return self.cast(q), scale

    def cast(self, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, layer: Linear, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [num_tokens, in_features]
        slabs = getattr(layer, self.slabs_attr, None)
        if slabs is None:
            out = kernels.w8a16_linear(rows, layer.qweight, layer.qscale, bias)
        else:
            out = self.fused_linear(rows, slabs, layer.qscale, bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    # The CPU backend's form of the matrix (an attribute of the layer) and its product.
    slabs_attr: str

    def fused_linear(self, rows: torch.Tensor, slabs: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class Int8WeightOnly(WeightOnly8Bit):
    """On the CPU backend with the fused kernels built, the int8 matrix is kept in the skinny
    kernel's 16-feature slabs instead (``layer.q8_slabs``, the same bytes padded to 16 rows;
    ``qweight`` released) and every product runs kernels/csrc/skinny_linear.cpp's
    skinny_linear_q8: the scale applied to each feature's fp32 sum. It streams a quarter of
    fp32's bytes and beats the twin at every row count measured (1-2048)."""

    weight_dtype = torch.int8
    qmax = 127.0

    def cast(self, q: torch.Tensor) -> torch.Tensor:
        return q.round_().clamp_(-127, 127).to(torch.int8)

    def process_weights(self, layer: Linear) -> None:
        super().process_weights(layer)
        ops = kernels.cpu.fused_kernels() if kernels.cpu_backend_active(layer.qweight) else None
        if ops is not None:
            layer.q8_slabs = pack_skinny_weight(layer.qweight)
            layer.qweight = torch.empty(0, dtype=torch.int8)

    slabs_attr = "q8_slabs"

    def fused_linear(self, rows: torch.Tensor, slabs: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        return kernels.cpu.fused_kernels().skinny_linear_q8(rows, slabs, scale, bias,
                                                            scale.numel())


class Fp8WeightOnly(WeightOnly8Bit):
    """On the CPU backend with the fused kernels built, the e4m3 matrix is kept in 16-feature
    slabs (``layer.f8_slabs``, kernels/cpu_quant.py; ``qweight`` released) and every product
    runs skinny_linear_f8: weights widened exactly on load, the scale applied to each feature's
    fp32 sum, as int8's q8 slabs."""

    weight_dtype = torch.float8_e4m3fn
    qmax = FP8_MAX

    def cast(self, q: torch.Tensor) -> torch.Tensor:
        return q.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def process_weights(self, layer: Linear) -> None:
        super().process_weights(layer)
        if kernels.cpu_backend_active(layer.qweight):
            slabs = cpu_quant.pack_fp8(layer.qweight)
            if slabs is not None:
                layer.f8_slabs = slabs
                layer.qweight = torch.empty(0, dtype=torch.float8_e4m3fn)

    slabs_attr = "f8_slabs"

    def fused_linear(self, rows: torch.Tensor, slabs: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_quant.fp8_linear(rows, slabs, scale, bias)


METHODS = {"int8": Int8WeightOnly, "fp8": Fp8WeightOnly, "gptq": GptqWeights,
           "awq": AwqWeights, "gguf": GgufWeights}


def make_method(qcfg: QuantConfig):
    """The linear method for a scheme (the grouped ones read their layout from `qcfg`)."""
    cls = METHODS[qcfg.scheme]
    return cls(qcfg) if issubclass(cls, (GptqWeights, AwqWeights)) else cls()


def per_row_scale(layer: Linear) -> torch.Tensor:
    """The checkpoint's `weight_scale` as one fp32 scale per output row of this rank [N]:
    per channel ([N] or [N, 1]) as is; per tensor broadcast, or for a fused layer (one scale
    per shard, [num_shards]) repeated over each shard's rows (quantization/loading.py)."""
    scale = layer.weight_scale.detach().float()
    rows = layer.weight.shape[0]
    layout, _ = layer.scale_layouts["weight_scale"]
    if layout == "channel":
        return scale.reshape(rows).contiguous()
    sizes = getattr(layer, "local_sizes", None)
    if sizes is not None:  # fused: one scale per shard
        return torch.repeat_interleave(scale.reshape(len(sizes)),
                                       torch.tensor(sizes, device=scale.device))
    return scale.reshape(1).expand(rows).contiguous()


def _reduce_over_ranks(layer: Linear):
    """Max over the ranks for a row-parallel layer split over several ranks, else None."""
    if not isinstance(layer, RowParallelLinear) or layer.tp_size == 1:
        return None

    def reduce_max(absmax: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX)
        return absmax

    return reduce_max


def quantized_weight(layer: Linear) -> torch.Tensor:
    """The layer's quantized matrix [N, K] as it holds it (`qweight`, or unpacked from the CPU
    backend's int8 or fp8 slabs)."""
    n = layer.qscale.numel()
    if hasattr(layer, "f8_slabs"):
        return cpu_quant.unpack_fp8(layer.f8_slabs, n)
    slabs = getattr(layer, "q8_slabs", None)
    if slabs is None:
        return layer.qweight
    return slabs.permute(0, 2, 1).reshape(-1, slabs.shape[1])[:n]


def quantized_weight_bytes(layer: Linear) -> int:
    """Bytes the layer's quantized weight and scales take."""
    weight = getattr(layer, "q8_slabs", getattr(layer, "f8_slabs", layer.qweight))
    return (weight.numel() * weight.element_size()
            + layer.qscale.numel() * layer.qscale.element_size())
