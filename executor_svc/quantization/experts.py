"""Quantized mixture-of-experts layers: every expert's projections as quantized linears.

A quantized `Experts` layer (models/moe.py) holds its per-expert form: expert e's gate|up and
down are a `MergedColumnParallelLinear` and a `RowParallelLinear` (``experts.e.gate_up_proj``,
``experts.e.down_proj``) whose `LinearMethod` is the scheme's own (quantization/methods.py:
int8 and fp8 weight-only with the CPU's fused slabs, GPTQ/AWQ's grouped weights). Nothing
about the schemes is written twice: an expert is quantized, stored and multiplied exactly as a
dense MLP's projections are.

How it gets there:

- ``--quantization int8|fp8`` (quantize at load): the float experts load stacked as usual
  (and gpt-oss's `finish_loading` rearranges them); `QuantizedExperts.process_weights` then
  hands each expert's slices to its linears and quantizes them one output row at a time like
  any projection. Under tensor parallelism down is row-parallel: its absmax is max-reduced over
  the ranks (one collective per expert and layer), so TP = n holds the TP = 1 model.
- A quantized checkpoint (fp8, GPTQ, AWQ) that stores an expert's tensors quantized
  (``experts.N.gate_proj.qweight``, Mixtral's ``experts.N.w1.weight_scale``...), or a
  converted GGUF file whose ``tensor_types`` lists an expert's weight (raw GGUF blocks):
  `prepare_expert_linears` turns the layer into its per-expert form while the model is on the
  meta device, the quantized loaders give those linears their packed parameters (GGUF: uint8
  block rows, quantization/gguf_loading.py), and the strict loader fills them by name
  (`Experts.linear_target`), each rank reading its slices; a missing expert tensor is named by
  its checkpoint name. A linear the checkpoint stores in float (a GGUF expert whose gate and
  up have different block types keeps them float, down raw) keeps the float method a dense
  layer of the model dtype gets, so one layer may mix float and quantized linears.

`QuantizedExperts.apply` computes `kernels.fused_moe`'s sum (twins.fused_moe is the oracle,
on the dequantized weights): the step's (token, slot) pairs sorted by expert id (stable), one
gather of their rows, then for each expert that some token chose, and only those, gate|up ->
the activation (SwiGLU, or gpt-oss's clamped one with its biases: `Experts.moe_options`) ->
down on its contiguous run of rows; the rows are weighted by the router weights in fp32 and
summed back into token order with one index_add_ (fp32), then cast to the model dtype. An
expert nobody chose is never read. On CUDA each product is its linear method's kernel, one
expert at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from checkpoints.files import TensorHeader
from executor_svc.models.linear import Linear, LinearMethod
from executor_svc.models.moe import Experts
from kernels import twins
from kernels.grouped_moe import grouped_moe

# Tensors whose presence says a checkpoint stores an expert's projection quantized.
QUANTIZED_TENSORS = ("qweight", "weight_scale")


def has_quantized_suffix(header: TensorHeader) -> bool:
    """fp8, GPTQ and AWQ: a tensor that only a quantized projection stores."""
    return header.name.rpartition(".")[2] in QUANTIZED_TENSORS


class QuantizedExperts:
    """The `ExpertsMethod` of the per-expert form (module docstring). `linear_method` is the
    scheme's: it quantizes the loaded float experts; an expert placed from a quantized
    checkpoint already has its linears' methods (quantize_model gives them, as to every
    linear)."""

    quantized = True

    def __init__(self, linear_method: LinearMethod):
        self.linear_method = linear_method

    def process_weights(self, layer: Experts) -> None:
        if layer.has_expert_linears:  # placed from a quantized checkpoint
            return
        layer.use_expert_linears()
        for expert in range(layer.num_experts):
            for linear in expert_linear_layers(layer, expert):
                linear.method = self.linear_method
                self.linear_method.process_weights(linear)  # releases its float slice

    def apply(self, layer: Experts, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        options = layer.moe_options()
        b13, b2 = options.get("w13_bias"), options.get("w2_bias")
        activation = options.get("activation", "silu")

        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up, down = expert_linear_layers(layer, expert)
            h = gate_up.method.apply(gate_up, rows, None if b13 is None else b13[expert])
            a = twins.moe_activation(h.float(), activation, options.get("swiglu_limit"),
                                     options.get("swiglu_alpha")).to(x.dtype)
            return down.method.apply(down, a, None if b2 is None else b2[expert])

        return grouped_moe(x, topk_weights, topk_ids, layer.num_experts, expert_mlp)


def expert_linear_layers(layer: Experts, expert: int) -> tuple[Linear, Linear]:
    """(gate_up_proj, down_proj) of one expert of a layer in the per-expert form."""
    linears = layer.expert(expert)
    return linears.gate_up_proj, linears.down_proj


def prepare_expert_linears(model: nn.Module, headers: list[TensorHeader],
                           stored_quantized: Callable[[TensorHeader], bool]
                           = has_quantized_suffix) -> int:
    """Before the quantized loaders run (meta device): turn every `Experts` layer whose
    checkpoint tensors include per-expert ones `stored_quantized` says are quantized into its
    per-expert form; returns how many. ValueError: such a tensor names an expert past the
    configured count."""
    count = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, Experts) or layer.has_expert_linears:
            continue
        prefix = f"{name}."
        if any(stored_quantized(h) and layer.linear_target(h.name[len(prefix):])
               for h in headers if h.name.startswith(prefix)):
            layer.use_expert_linears()
            count += 1
    return count


def dequantized_experts(layer: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I/tp, hidden], w2 [E, hidden, I/tp]) fp32: the matrices a quantized layer's
    linears multiply by (tests and tools; twins.fused_moe on them is the layer's oracle)."""
    from executor_svc.quantization.grouped import grouped_of
    from executor_svc.quantization.methods import quantized_weight

    def matrix(linear: Linear) -> torch.Tensor:
        if not getattr(linear.method, "quantized", False):  # stored in float (plain kept)
            return linear.weight.float()
        if hasattr(linear, "qscale"):  # 8-bit weight-only
            return quantized_weight(linear).float() * linear.qscale[:, None]
        gw, perm = grouped_of(linear)
        w = gw.dequantize()  # W[:, perm] where the input is permuted
        if perm is None:
            return w
        out = torch.empty_like(w)
        out[:, perm] = w
        return out

    pairs = [tuple(map(matrix, expert_linear_layers(layer, e))) for e in range(layer.num_experts)]
    return (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
