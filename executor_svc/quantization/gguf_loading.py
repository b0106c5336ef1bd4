"""A converted GGUF file's raw block rows in the loader (scheme "gguf": checkpoints/quant_config).

Every layer whose weight config.json's ``quantization_config.tensor_types`` lists (a projection,
a MoE expert's gate|up or down once its layer is in the per-expert form, quantization/
experts.py; the untied LM head; the embedding) gets, while the model is still on the meta
device, a uint8 ``weight`` [N, row_bytes] (its rows of GGUF blocks) and ``layer.gguf_type``, so
the strict loader (executor_svc/loading/loader.py) checks and fills it like any other
parameter. A fused layer (q|k|v, gate|up) stacks its shards' raw rows, so all its shards must
be listed, with one type (the converter writes them so). The vocab-parallel embedding and LM
head split rows, whole.

Tensor parallelism splits the bytes where the layer splits the elements: a column-parallel
layer takes whole rows (a block never spans two rows); a row-parallel one
(o_proj, down_proj, an expert's down_proj) takes a range of each row's input columns, which must
be whole blocks, i.e. K / tp a multiple of the type's block (32 elements, 256 for the K-quants);
otherwise loading is refused, naming --tensor-parallel-size and the layer.

`GgufWeights` (scheme "gguf" in methods.METHODS) unpacks a layer's raw rows into the grouped
form (gguf_blocks.py) and multiplies by it through `GroupedWeightOnly`: Q4_0, Q4_1 and Q4_K
layers hold 4-bit nibbles (K / 2 bytes a row), Q8_0 and Q6_K int8 (K bytes a row), each with
fp32 scales (and offsets) per group of 32 (Q6_K: 16) inputs. The embedding dequantizes the
rows it looks up (models/parallel.py); a tied LM head multiplies by the grouped form of the
embedding's raw rows (`TiedGgufWeights`, built once at load; the raw rows stay for lookups).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from checkpoints.files import CheckpointError, TensorHeader
from executor_svc.models.linear import Linear
from executor_svc.models.parallel import (
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightShard,
    replicated,
)
from executor_svc.quantization.gguf_blocks import BLOCK_TYPES, row_bytes, unpack_blocks
from executor_svc.quantization.grouped import GroupedWeight, GroupedWeightOnly

RAW_HEADER_DTYPE = "U8"


def prepare_gguf_params(model: nn.Module, targets: list[tuple[str, int | None, TensorHeader]],
                        tensor_types: dict[str, str], config_path) -> int:
    """Give every listed layer its raw uint8 weight parameter (on the meta device). `targets`:
    (model parameter name, fused shard id, header) for every checkpoint tensor. Returns how
    many layers hold raw blocks."""
    found: dict[str, dict[int | None, str]] = {}  # layer -> shard id -> type
    listed = set(tensor_types)
    for pname, shard_id, header in targets:
        kind = tensor_types.get(header.name)
        if kind is None:
            continue
        listed.discard(header.name)
        module_name, _, param_name = pname.rpartition(".")
        try:
            layer = model.get_submodule(module_name)
        except AttributeError:
            continue  # no such layer: the loader reports the tensor as unexpected
        if param_name != "weight" or not isinstance(layer, (Linear, VocabParallelEmbedding)):
            raise CheckpointError(config_path, f"quantization_config.tensor_types lists "
                                               f"{header.name}, which is not the weight of a "
                                               "projection, the embedding or the LM head: "
                                               "only those may be GGUF blocks")
        found.setdefault(module_name, {})[shard_id] = kind
    if listed:
        raise CheckpointError(config_path, f"quantization_config.tensor_types lists tensors "
                                           f"the checkpoint lacks: {', '.join(sorted(listed)[:5])}")
    for module_name, kinds in found.items():
        layer = model.get_submodule(module_name)
        shards = len(getattr(layer, "output_sizes", None) or [None])
        if len(set(kinds.values())) > 1 or len(kinds) != shards:
            raise CheckpointError(config_path, f"the projections fused into {module_name} must "
                                               f"all be GGUF blocks of one type, got "
                                               f"{sorted(kinds.values())} for {shards} shards")
        kind = next(iter(kinds.values()))
        _check_whole_blocks(layer, module_name, kind, config_path)
        layer.gguf_type = kind
        rows, k = _rows_and_inputs(layer)
        layer.weight = nn.Parameter(torch.empty((rows, row_bytes(kind, k)), dtype=torch.uint8,
                                                device="meta"), requires_grad=False)
    return len(found)


def _rows_and_inputs(layer: Linear | VocabParallelEmbedding) -> tuple[int, int]:
    """(this rank's rows, elements per row) of the layer's weight matrix."""
    if isinstance(layer, VocabParallelEmbedding):
        return layer.num_embeddings, layer.embedding_dim
    return layer.out_features, layer.in_features


def _check_whole_blocks(layer: Linear | VocabParallelEmbedding, module_name: str, kind: str,
                        config_path) -> None:
    elems = BLOCK_TYPES[kind][0]
    k = _rows_and_inputs(layer)[1]
    full_k = getattr(layer, "full_in_features", k)
    if full_k % elems:
        raise CheckpointError(config_path, f"{module_name} has {full_k} inputs, not whole "
                                           f"{kind} blocks of {elems}")
    if k % elems:
        assert isinstance(layer, RowParallelLinear)
        raise ValueError(f"--tensor-parallel-size {layer.tp_size}: {module_name} is stored as "
                         f"{kind} blocks of {elems} inputs, and splitting its {full_k} inputs "
                         f"over {layer.tp_size} ranks leaves {layer.in_features} per rank, not "
                         f"whole blocks; pick a size that leaves each rank a multiple of "
                         f"{elems} inputs")


def gguf_weight_shard(layer: Linear | VocabParallelEmbedding,
                      shard_id: int | None) -> WeightShard:
    """What this rank reads of a raw block tensor: the layer's own element shard, in bytes."""
    describe = getattr(layer, "weight_shard", None)
    if describe is None:
        return replicated(layer.weight)
    shard = describe("weight", shard_id)
    elems, size = BLOCK_TYPES[layer.gguf_type]

    def to_bytes(columns: int) -> int:
        return columns // elems * size

    full = (shard.full_shape[0], to_bytes(shard.full_shape[1]))
    if shard.dim == 1:  # row-parallel: whole blocks (checked by prepare_gguf_params)
        return WeightShard(full, 1, to_bytes(shard.start), to_bytes(shard.size),
                           to_bytes(shard.dest_start))
    return dataclasses.replace(shard, full_shape=full)


def check_raw_header(header: TensorHeader, param: torch.Tensor) -> None:
    """Raw blocks (U8) go only into a layer listed as GGUF blocks, and back."""
    is_raw = param.dtype == torch.uint8
    if (header.dtype == RAW_HEADER_DTYPE) == is_raw:
        return
    if is_raw:
        problem = (f"tensor {header.name} has dtype {header.dtype}, but quantization_config."
                   f"tensor_types lists it as GGUF blocks, stored as {RAW_HEADER_DTYPE}")
    else:
        problem = (f"tensor {header.name} is {RAW_HEADER_DTYPE} but config.json's "
                   "quantization_config.tensor_types does not list it as GGUF blocks")
    raise CheckpointError(header.file, problem)


class GgufWeights(GroupedWeightOnly):
    weight_dtype = torch.uint8  # what quantize_model picks the checkpoint's layers by

    def holds(self, layer) -> bool:
        return getattr(layer, "gguf_type", None) is not None

    def grouped_weight(self, layer) -> GroupedWeight:
        raw = layer.weight.detach()
        if raw.numel() == 0:
            raise ValueError("GgufWeights: the layer's raw blocks were released")
        gw = unpack_blocks(raw, layer.gguf_type, layer.in_features)
        layer.weight.data = torch.empty(0, dtype=raw.dtype, device=raw.device)
        return gw


class TiedGgufWeights(GgufWeights):
    """The tied LM head (models/linear.py `TiedHead`) of an embedding kept as GGUF blocks:
    its grouped form is unpacked from the embedding's raw rows, which stay (the embedding
    looks its rows up in them)."""

    def holds(self, head) -> bool:
        return getattr(head.embedding, "gguf_type", None) is not None

    def grouped_weight(self, head) -> GroupedWeight:
        embedding = head.embedding
        return unpack_blocks(embedding.weight.detach(), embedding.gguf_type,
                             embedding.embedding_dim)
