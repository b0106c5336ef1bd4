"""Quantized weights in the loader: an fp8 checkpoint's parameters, where each rank's share of
a scale comes from, and the pass that gives the linear layers their quantized method.

An fp8 checkpoint layer (one with a ``weight_scale`` tensor) gets, while the model is still on
the meta device, an e4m3 ``weight`` and fp32 ``weight_scale`` (and ``input_scale``)
parameters, so the strict loader (executor_svc/loading/loader.py) accounts for every tensor as usual.
``layer.scale_layouts[name] = (layout, checkpoint_shape)`` records how each scale is stored:

    "tensor"   one scalar per checkpoint tensor; a fused layer (q|k|v, gate|up) keeps one per
               shard, parameter [num_shards]; replicated on every rank
    "channel"  one per output row, [N] or [N, 1]: split like the weight's rows for a
               column-parallel layer, replicated for a row-parallel one (its rows are whole)
"""

from __future__ import annotations

import math

import structlog
import torch
from torch import nn

from checkpoints.files import PACKED_DTYPES, CheckpointError, TensorHeader
from checkpoints.quant_config import QuantConfig
from executor_svc.models.linear import Linear, TiedHead
from executor_svc.models.moe import Experts
from executor_svc.models.parallel import WeightShard
from executor_svc.quantization import gptq
from executor_svc.quantization.experts import QuantizedExperts
from executor_svc.quantization.gguf_loading import TiedGgufWeights, check_raw_header
from executor_svc.quantization.methods import make_method

log = structlog.get_logger(__name__)

SCALE_PARAMS = ("weight_scale", "input_scale")
FP8_HEADER_DTYPE = "F8_E4M3"


def prepare_checkpoint_params(model: nn.Module,
                              targets: list[tuple[str, int | None, TensorHeader]],
                              qcfg: QuantConfig) -> int:
    """Give every layer the checkpoint stores quantized the parameters its tensors fill, on
    the meta device (GPTQ and AWQ: quantization/gptq.py). `targets`: (model parameter name,
    fused shard id, header) for every checkpoint tensor. Returns how many layers are stored
    quantized. ValueError: the layout cannot be split over the ranks."""
    if qcfg.scheme in ("gptq", "awq"):
        return gptq.prepare_params(model, targets, qcfg)
    return _prepare_fp8(model, targets)


def _prepare_fp8(model: nn.Module, targets: list[tuple[str, int | None, TensorHeader]]) -> int:
    """fp8: e4m3 weights and fp32 scale parameters (see the module docstring)."""
    found: dict[str, dict[str, list[TensorHeader]]] = {}
    for pname, _, header in targets:
        module_name, _, param_name = pname.rpartition(".")
        if param_name not in SCALE_PARAMS:
            continue
        try:
            layer = model.get_submodule(module_name)
        except AttributeError:
            continue  # no such layer: the loader reports the tensor as unexpected
        if isinstance(layer, Linear):
            found.setdefault(module_name, {}).setdefault(param_name, []).append(header)
    count = 0
    for module_name, scales in found.items():
        if "weight_scale" not in scales:
            continue  # an input_scale alone has no home: reported by the loader
        layer = model.get_submodule(module_name)
        layer.scale_layouts = {}
        for param_name, headers in scales.items():
            layout, shape = _scale_layout(headers)
            layer.scale_layouts[param_name] = (layout, shape)
            if layout == "channel":
                param_shape: tuple[int, ...] = (layer.out_features,) + shape[1:]
            elif hasattr(layer, "output_sizes"):
                param_shape = (len(layer.output_sizes),)
            else:
                param_shape = shape
            layer.register_parameter(param_name, nn.Parameter(
                torch.empty(param_shape, dtype=torch.float32, device="meta"),
                requires_grad=False))
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=torch.float8_e4m3fn,
                                                device="meta"), requires_grad=False)
        count += 1
    return count


def _scale_layout(headers: list[TensorHeader]) -> tuple[str, tuple[int, ...]]:
    """("tensor" | "channel", the checkpoint's shape for one shard) of one layer's scale; every
    shard of a fused layer must store it the same way."""
    kinds = {("tensor" if math.prod(h.shape) == 1 else "channel", len(h.shape)) for h in headers}
    shapes = {h.shape for h in headers}
    layout = next(iter(kinds))[0]
    if len(kinds) > 1 or (layout == "tensor" and len(shapes) > 1) or len(
            next(iter(shapes))) > 2:
        names = ", ".join(f"{h.name} {list(h.shape)}" for h in headers)
        raise CheckpointError(headers[0].file, f"scales of one layer stored in different or "
                                               f"unknown layouts: {names}; expected all per "
                                               f"tensor ([] or [1]) or all per channel ([N] or "
                                               f"[N, 1])")
    return layout, headers[0].shape if layout == "tensor" else (0,) + headers[0].shape[1:]


def scale_shard(layer: Linear, param_name: str, shard_id: int | None) -> WeightShard:
    """What this rank reads of a checkpoint scale (see the module docstring)."""
    layout, shape = layer.scale_layouts[param_name]
    if layout == "tensor":
        return WeightShard(shape, dest_index=shard_id)
    weight = layer.weight_shard("weight", shard_id)
    full = (weight.full_shape[0],) + shape[1:]
    if weight.dim == 0:
        return WeightShard(full, 0, weight.start, weight.size, weight.dest_start)
    return WeightShard(full)  # row-parallel: each rank holds whole rows


def check_header_dtype(header: TensorHeader, param: torch.Tensor) -> None:
    """An e4m3 tensor goes only into an e4m3 parameter and back: a silent cast would drop its
    scale (a float weight in an fp8 layer, an fp8 weight in a float one); GGUF blocks only
    into a layer listed as GGUF blocks (gguf_loading.py); packed integers only into the
    integer parameters of a layer its scheme declares quantized."""
    check_raw_header(header, param)
    is_int = not param.dtype.is_floating_point
    if (header.dtype in PACKED_DTYPES) != is_int:
        what = (f"holds packed integers ({header.dtype}), but config.json declares no "
                "quantization_config whose layers store it" if not is_int else
                f"has dtype {header.dtype}, but its quantized layer stores packed integers")
        raise CheckpointError(header.file, f"tensor {header.name} {what}")
    is_fp8 = param.dtype == torch.float8_e4m3fn
    if (header.dtype == FP8_HEADER_DTYPE) != is_fp8:
        if is_fp8:
            problem = (f"tensor {header.name} has dtype {header.dtype}, but its layer has a "
                       f"weight_scale: fp8 layers store their weight in {FP8_HEADER_DTYPE}")
        else:
            problem = (f"tensor {header.name} is {FP8_HEADER_DTYPE} but has no weight_scale "
                       f"(or config.json declares no fp8 quantization_config)")
        raise CheckpointError(header.file, problem)


def quantize_model(model: nn.Module, qcfg: QuantConfig) -> int:
    """Give the linear layers the scheme's method and let it quantize them (not the LM head,
    kept in the model dtype), or take the checkpoint's quantized weights, and only those (the
    LM head's too, and a tied head's where the embedding is stored as GGUF blocks); the same
    for the mixture-of-experts layers' experts (quantization/experts.py: quantized at load, or
    those a quantized checkpoint stores quantized). Returns how many layers are quantized."""
    method = make_method(qcfg)
    lm_head = getattr(model, "lm_head", None)
    layers: list = [m for m in model.modules() if isinstance(m, Linear)
                    and (m is not lm_head or qcfg.from_checkpoint)]
    if qcfg.from_checkpoint:
        layers = [m for m in layers if method.holds(m)]
    # Quantized at load: every layer's experts. From a checkpoint: the layers it stores
    # quantized, already in their per-expert form, whose linears are among `layers`.
    experts = [m for m in model.modules() if isinstance(m, Experts)
               and (m.has_expert_linears or not qcfg.from_checkpoint)]
    with torch.no_grad():
        for layer in layers:
            layer.method = method
            method.process_weights(layer)
        for moe in experts:
            moe.method = QuantizedExperts(method)
            moe.method.process_weights(moe)
        tied = TiedGgufWeights()
        if qcfg.scheme == "gguf" and isinstance(lm_head, TiedHead) and tied.holds(lm_head):
            lm_head.method = tied
            tied.process_weights(lm_head)
            layers.append(lm_head)
    log.info("linear layers quantized", scheme=qcfg.scheme, layers=len(layers),
             expert_layers=len(experts), from_checkpoint=qcfg.from_checkpoint)
    return len(layers)
