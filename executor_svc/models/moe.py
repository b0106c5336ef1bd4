"""Mixture-of-experts blocks: a softmax top-k router, the experts as one `FusedMoE` layer, and
(Qwen2-MoE) a gated shared expert.

Router (`TopKRouter`), as transformers 5.24 computes it: logits = x W_r^T in the model dtype,
softmax over all experts in fp32, ``torch.topk`` (the op HF's router calls, so ties go as HF's),
then the k probabilities renormalised to sum to one when the family does (Mixtral always, the
Qwen families when norm_topk_prob). The Qwen routers round the weights to the model dtype, as
HF's do; Mixtral's stay fp32. The router is replicated on every tensor-parallel rank.

`FusedMoE` holds every expert's SwiGLU weights stacked, in the layout `kernels.fused_moe` takes:
w13 [E, 2 * I / tp, hidden] (this rank's gate rows, then its up rows) and w2 [E, hidden, I / tp].
Tensor parallel: each rank holds the same slice of every expert's intermediate dimension (gate
and up sliced alike, down's matching columns), so no token moves between ranks; every rank
computes its partial sum of every routed expert and one all_reduce per MoE block (after the
shared expert's partial sum is added) completes it, like RowParallelLinear's.

Checkpoint layouts (the loader asks the layer, `checkpoint_placements`): one tensor per expert
and projection (``experts.N.gate_proj/up_proj/down_proj.weight``, Mixtral's ``experts.N.w1/w3/
w2.weight``; what transformers 5.24's save_pretrained writes for all three families), or the
stacked 3-D tensors of transformers 5's own modules (``experts.gate_up_proj`` [E, 2I, hidden],
gate rows first, and ``experts.down_proj`` [E, hidden, I]). Each rank reads only its slices.

Quantized experts (executor_svc/quantization/experts.py) use the layer's second form, one
`ExpertLinears` per expert (submodules ``"0"``, ``"1"``, ...: ``experts.N.gate_up_proj`` and
``experts.N.down_proj``), so every quantized linear method serves an expert as it serves a
dense MLP, and a quantized checkpoint's per-expert tensors (``experts.N.gate_proj.qweight``,
``experts.N.w2.weight_scale``..., a converted GGUF file's raw ``experts.N.down_proj.weight``)
load by name like any fused projection's (`linear_target`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

import kernels.cpu
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.layers import GatedMLP
from executor_svc.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from executor_svc.models.parallel import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    WeightShard,
)
from executor_svc.parallel import distributed
from kernels import fused_moe, silu_and_mul

# Checkpoint names of an expert's gate, up and down projections.
QWEN_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_PARTS = ("w1", "w3", "w2")

_PER_EXPERT = re.compile(r"(\d+)\.(\w+)\.weight")
_PER_EXPERT_TENSOR = re.compile(r"(\d+)\.(\w+)\.(\w+)")


class ReplicatedLinear(nn.Module):
    """A small projection every rank holds whole and computes with plain ``F.linear`` (the
    router, the shared expert's gate): not a `Linear`, so never packed or quantized, and its
    product is HF's bit for bit."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TopKRouter(ReplicatedLinear):
    """x [T, hidden] -> (weights [T, k] fp32, expert ids [T, k] int64)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, round_weights: bool):
        super().__init__(cfg.hidden_size, cfg.num_experts, dtype)
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.round_weights = round_weights

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(x)  # [T, num_experts] in the model dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(logits.dtype).float()
        return weights, ids


class ExpertsMethod(Protocol):
    """How an `Experts` layer's weights are stored and multiplied, like models/linear.py's
    `LinearMethod` for a projection: `DENSE_EXPERTS` (the stacked form, in the model dtype)
    or executor_svc/quantization/experts.py's `QuantizedExperts` (the per-expert form)."""

    def process_weights(self, layer: Experts) -> None:
        """Called once after the weights are loaded (and `finish_loading`); may turn the
        layer into its per-expert form and quantize it."""

    def apply(self, layer: Experts, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> this rank's partial sum of the routed experts, [T, hidden]."""


class DenseExperts:
    def process_weights(self, layer: Experts) -> None:
        pass

    def apply(self, layer: Experts, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, **layer.moe_options())


DENSE_EXPERTS = DenseExperts()


class PackedCpuExperts:
    """The CPU backend with the fused kernels: the experts packed once into the fused MoE
    kernel's slabs (`kernels.cpu.PackedExperts`, ``layer.packed``), which replace w13/w2
    (released unless `keep_plain`), so the experts take the memory they took before; decode
    steps stream each touched expert's slabs once, larger ones unpack the touched experts
    (kernels.cpu.fused_moe_packed)."""

    def __init__(self, keep_plain: bool = False):
        self.keep_plain = keep_plain

    def process_weights(self, layer: Experts) -> None:
        layer.packed = kernels.cpu.pack_moe_weights(layer.w13.data, layer.w2.data)
        if not self.keep_plain:
            for name in ("w13", "w2"):
                getattr(layer, name).data = torch.empty(0, dtype=layer.w13.dtype)

    def apply(self, layer: Experts, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return kernels.cpu.fused_moe_packed(x, layer.packed, topk_weights, topk_ids,
                                            **layer.moe_options())


def use_experts_method(model: nn.Module, method: ExpertsMethod,
                       after_each: Callable[[], object] | None = None) -> int:
    """Give every `Experts` layer still on `DENSE_EXPERTS` the `method` (a quantized layer keeps
    its own); returns how many took it. `after_each` runs after each layer's weights are
    processed (the executor returns the memory a layer's replaced weights held)."""
    layers = [m for m in model.modules() if isinstance(m, Experts) and m.method is DENSE_EXPERTS]
    for layer in layers:
        layer.method = method
        method.process_weights(layer)
        if after_each is not None:
            after_each()
    return len(layers)


class ExpertLinears(nn.Module):
    """One expert's SwiGLU projections as the per-expert form of an `Experts` layer holds them:
    ``gate_up_proj`` (gate rows, then up rows: w13[e]) and ``down_proj`` (w2[e]), the
    tensor-parallel layers of a dense MLP, so each rank holds the same slices the stacked form
    does and a row-parallel quantizer reduces down's absmax over the ranks. No biases: gpt-oss's
    stay with its `Experts` layer (`moe_options`). `checkpoint_names` are the checkpoint's
    names of each layer's parts, which a missing tensor is reported by."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 part_names: tuple[str, str, str]):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       False, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, dtype)
        self.gate_up_proj.checkpoint_names = part_names[:2]
        self.down_proj.checkpoint_names = part_names[2:]


class Experts(nn.Module):
    """Every expert of one MoE layer, in one of two forms. Stacked (as built): w13 [E, 2I/tp,
    hidden] (gate rows, then up rows) and w2 [E, hidden, I/tp], the layout `kernels.fused_moe`
    takes. Per expert (`use_expert_linears`; quantized experts): submodule ``str(e)`` is expert
    e's `ExpertLinears` and w13/w2 are gone. `forward` returns this rank's partial sum, which
    the caller all-reduces; its `method` decides how the weights are stored and multiplied,
    and must suit the form (`DENSE_EXPERTS` the stacked one)."""

    method: ExpertsMethod = DENSE_EXPERTS
    num_experts: int
    hidden_size: int
    intermediate_size: int  # per expert, whole (every rank holds intermediate_size / tp)
    part_names: tuple[str, str, str] = QWEN_EXPERT_PARTS
    has_expert_linears = False
    w13: torch.Tensor
    w2: torch.Tensor

    def moe_options(self) -> dict:
        """`kernels.fused_moe`'s keyword options for this layer: biases, activation."""
        return {}

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, topk_weights, topk_ids)  # [T, hidden]

    def use_expert_linears(self) -> None:
        """Stacked form -> per-expert form. Loaded values are handed over as views of the
        stacked tensors (each linear's method then quantizes and releases its own); on the meta
        device the linears stay unallocated, for the loader to fill from the checkpoint."""
        w13, w2 = self.w13.data, self.w2.data
        for expert in range(self.num_experts):
            with torch.device("meta"):
                linears = ExpertLinears(self.hidden_size, self.intermediate_size, w13.dtype,
                                        self.part_names)
            if not w13.is_meta:
                linears.gate_up_proj.weight = nn.Parameter(w13[expert], requires_grad=False)
                linears.down_proj.weight = nn.Parameter(w2[expert], requires_grad=False)
            self.add_module(str(expert), linears)
        del self.w13, self.w2
        self.has_expert_linears = True

    def expert(self, index: int) -> ExpertLinears:
        """Expert `index`'s linears (the per-expert form)."""
        return self._modules[str(index)]  # type: ignore[return-value]

    def linear_target(self, key: str) -> tuple[str, int | None] | None:
        """Where a per-expert checkpoint tensor `key` (relative to this module) goes in the
        per-expert form: (parameter relative to this module, fused shard id); None when the
        checkpoint names no expert tensors of its own (gpt-oss stores only 3-D ones)."""
        return None


class FusedMoE(Experts):
    """Every expert's SwiGLU MLP in two stacked parameters (module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, part_names: tuple[str, str, str] = QWEN_EXPERT_PARTS):
        super().__init__()
        self.tp_size, self.tp_rank = distributed.tp_size(), distributed.tp_rank()
        assert intermediate_size % self.tp_size == 0, "checked by check_tensor_parallel"
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_intermediate = intermediate_size // self.tp_size
        self.part_names = part_names
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local_intermediate,
                                            hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_intermediate,
                                           dtype=dtype), requires_grad=False)

    # Loading (executor_svc/loading/loader.py). Labels are checkpoint tensor names relative to
    # this module, in the per-expert layout: what a checkpoint that lacks them is told.

    def checkpoint_parts(self, param_name: str) -> list[str]:
        """The per-expert tensors that fill parameter `param_name`."""
        gate, up, down = self.part_names
        if param_name == "w13":
            return [f"{e}.{part}.weight" for e in range(self.num_experts) for part in (gate, up)]
        return [f"{e}.{down}.weight" for e in range(self.num_experts)]

    def linear_target(self, key: str) -> tuple[str, int | None] | None:
        """``N.<gate>.<param>`` -> (``N.gate_up_proj.<param>``, 0), up -> shard 1, down ->
        (``N.down_proj.<param>``, None). ValueError for an expert index past the configured
        count."""
        match = _PER_EXPERT_TENSOR.fullmatch(key)
        if match is None or match.group(2) not in self.part_names:
            return None
        expert, part = self._expert_index(match.group(1)), self.part_names.index(match.group(2))
        if part == 2:
            return f"{expert}.down_proj.{match.group(3)}", None
        return f"{expert}.gate_up_proj.{match.group(3)}", part

    def _expert_index(self, text: str) -> int:
        expert = int(text)
        if expert >= self.num_experts:
            raise ValueError(f"expert {expert} is past the {self.num_experts} experts "
                             "config.json states (num_experts / num_local_experts)")
        return expert

    def checkpoint_placements(self, key: str) -> list[tuple[str, list[str], WeightShard]] | None:
        """Where checkpoint tensor `key` (relative to this module) goes on this rank in the
        stacked form: (parameter, the labels it fills, shard) entries; None when it is no
        tensor of an expert. ValueError for an expert index past the configured count. (The
        per-expert form's linears load by name: `linear_target`.)"""
        n, il = self.intermediate_size, self.local_intermediate
        start = self.tp_rank * il
        e_count, hidden = self.num_experts, self.hidden_size
        if key == "gate_up_proj":  # [E, 2I, hidden]: gate rows, then up rows
            full = (e_count, 2 * n, hidden)
            return [("w13", self.checkpoint_parts("w13"),
                     WeightShard(full, 1, part * n + start, il, part * il)) for part in (0, 1)]
        if key == "down_proj":  # [E, hidden, I]
            return [("w2", self.checkpoint_parts("w2"),
                     WeightShard((e_count, hidden, n), 2, start, il))]
        match = _PER_EXPERT.fullmatch(key)
        if match is None or match.group(2) not in self.part_names:
            return None
        expert, part = self._expert_index(match.group(1)), self.part_names.index(match.group(2))
        if part == 2:  # down [hidden, I]: this rank's columns
            return [("w2", [key], WeightShard((hidden, n), 1, start, il, 0, expert=expert))]
        return [("w13", [key], WeightShard((n, hidden), 0, start, il, part * il,
                                           expert=expert))]


class SparseMoeBlock(nn.Module):
    """The MLP of a MoE decoder layer: router, experts and, with a
    shared_expert_intermediate_size, Qwen2-MoE's shared expert scaled by
    sigmoid(shared_expert_gate(x)). One all_reduce in all under tensor parallelism."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, part_names: tuple[str, str, str],
                 round_router_weights: bool):
        super().__init__()
        self.tp_size = distributed.tp_size()
        self.gate = TopKRouter(cfg, dtype, round_router_weights)
        self.experts = FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                dtype, part_names)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                          False, dtype)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate.route(x)
        out = self.experts(x, topk_weights, topk_ids)  # this rank's partial sum
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            down = self.shared_expert.down_proj
            # Its own partial sum (no bias), reduced together with the experts'.
            shared = down.method.apply(down, silu_and_mul(self.shared_expert.gate_up_proj(x)),
                                       None)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out if self.tp_size == 1 else distributed.all_reduce(out)


def moe_layer_ffn(cfg: ModelConfig, dtype: torch.dtype, layer_idx: int,
                  part_names: tuple[str, str, str], round_router_weights: bool) -> nn.Module:
    """A decoder layer's feed-forward block: a `SparseMoeBlock` where `ModelConfig.is_moe_layer`
    says so, else a dense SwiGLU MLP of intermediate_size."""
    if cfg.is_moe_layer(layer_idx):
        return SparseMoeBlock(cfg, dtype, part_names, round_router_weights)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, dtype)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-shaped model whose decoder layers hold `moe_layer_ffn`'s blocks; the families set the
    MoE block's name, their experts' checkpoint names and the router's rounding."""

    ffn_name = "mlp"
    # No decode CUDA graphs (executor_svc/worker.py): kernels.fused_moe's twin picks the
    # routed experts on the host.
    cuda_graphs = False
    expert_part_names: tuple[str, str, str] = QWEN_EXPERT_PARTS
    round_router_weights = True

    @classmethod
    def make_model(cls, cfg: ModelConfig, backend, dtype: torch.dtype) -> nn.Module:
        layers = [LlamaDecoderLayer(cfg, cls.make_attention(cfg, backend, dtype, i), dtype,
                                    moe_layer_ffn(cfg, dtype, i, cls.expert_part_names,
                                                  cls.round_router_weights), cls.ffn_name)
                  for i in range(cfg.num_layers)]
        return LlamaModel(cfg, layers, dtype)  # type: ignore[arg-type]
