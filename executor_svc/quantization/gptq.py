"""GPTQ and AWQ checkpoints: their packed tensors in the loader, and their unpacking into the
`GroupedWeight` every grouped scheme shares (quantization/grouped.py).

On disk (config.py has the config fields), for a layer y = x W^T with W [N, K], groups of
`group_size` input columns and pf = 32 / bits values per int32, value i of a word in bits
[bits*i, bits*(i+1)):

    GPTQ  qweight int32 [K/pf, N]   word (r, n) holds W's column n at rows k = r*pf + i
          qzeros  int32 [G, N/pf]   word (g, c) holds the zero points of columns c*pf + i;
                                    the original format ("gptq") stores z - 1
          scales        [G, N]      g_idx int32 [K]: the group of input k (act order)
    AWQ   qweight int32 [K, N/8]    word (k, c) holds columns c*8 + AWQ_ORDER[i] of row k
          qzeros  int32 [G, N/8]    the same interleaved order
          scales        [G, N]      the group of input k is k // group_size

and W[n, k] = (q - z) * scale in both. Unpacked: 4-bit values as they are with the offset
-z * scale (exact in fp32 for fp16 scales), GPTQ 8-bit values minus 128 as int8 with the
offset (128 - z) * scale.

Loading: while the model is on the meta device, each layer the checkpoint stores quantized
loses its float ``weight`` and gets these tensors as parameters (int32, scales fp32; a fused
layer stacks its shards along N, and keeps one g_idx per shard, which must agree), so the
strict loader accounts for every one. Tensor parallelism: column-parallel layers read their
columns of N (whole int32 words: N / tp must be a multiple of the pack factor where N is
packed), row-parallel layers their rows of K (qweight's and g_idx's; scales and zeros are
read whole and the groups a rank's columns use are kept).
"""

from __future__ import annotations

import torch
from torch import nn

from checkpoints.files import TensorHeader
from checkpoints.quant_config import QuantConfig
from executor_svc.models.linear import Linear
from executor_svc.models.parallel import WeightShard
from executor_svc.quantization.grouped import GroupedWeight, GroupedWeightOnly

PARAMS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value i of an AWQ word is column AWQ_ORDER[i]


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> the unsigned values they pack, in order, along `dim` (int32)."""
    pf = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., pf]
    values = values.movedim(-1, dim + 1) if dim + 1 < words.dim() else values
    shape = list(words.shape)
    shape[dim] *= pf
    return values.reshape(shape)


def gptq_grouped(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor, bits: int, group_size: int,
                 zeros_minus_one: bool) -> GroupedWeight:
    """A GPTQ layer's tensors (this rank's: g_idx holds global group ids) -> GroupedWeight."""
    q = unpack_words(qweight, bits, 0).t()  # [N, K]
    z = unpack_words(qzeros, bits, 1)[:, :scales.shape[1]] + int(zeros_minus_one)  # [G, N]
    s = scales.float()
    if bits == 8:  # unsigned 0..255 stored as int8 q - 128: the offset absorbs the 128
        qv, offsets = (q - 128).to(torch.int8), (128 - z).float() * s
    else:
        qv, offsets = q.to(torch.uint8), -z.float() * s
    return GroupedWeight(qv.contiguous(), s.t().contiguous(), offsets.t().contiguous(),
                         group_size if group_size > 0 else q.shape[1], g_idx.to(torch.int32))


def awq_grouped(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group_size: int, k_start: int) -> GroupedWeight:
    """An AWQ layer's tensors (this rank's rows of K start at `k_start`) -> GroupedWeight."""
    order = torch.tensor(AWQ_ORDER).argsort()  # column j of a word sits at value order[j]

    def columns(words: torch.Tensor) -> torch.Tensor:
        values = unpack_words(words, 4, 1).view(words.shape[0], -1, 8)
        return values[:, :, order].reshape(words.shape[0], -1)

    q = columns(qweight).t()  # [N, K]
    z = columns(qzeros)  # [G, N]
    s = scales.float()
    k = q.shape[1]
    gs = group_size if group_size > 0 else k
    g_idx = ((torch.arange(k) + k_start) // gs).to(torch.int32)
    return GroupedWeight(q.to(torch.uint8).contiguous(), s.t().contiguous(),
                         (-z.float() * s).t().contiguous(), gs, g_idx)


class GptqWeights(GroupedWeightOnly):
    def __init__(self, qcfg: QuantConfig):
        self.qcfg = qcfg

    def holds(self, layer: Linear) -> bool:
        return "qweight" in layer._parameters

    def grouped_weight(self, layer: Linear) -> GroupedWeight:
        t = _take_params(layer)
        g_idx = t.get("g_idx")
        k = t["qweight"].shape[0] * 32 // self.qcfg.bits
        if g_idx is not None and g_idx.numel() > k:  # a fused layer: one per shard
            shards = g_idx.view(-1, k)
            if not bool((shards == shards[:1]).all()):
                raise ValueError(f"{type(layer).__name__}: the fused projections' g_idx differ "
                                 "(act order must be shared by q|k|v and by gate|up)")
            g_idx = shards[0]
        if g_idx is None:
            gs = self.qcfg.group_size if self.qcfg.group_size > 0 else k
            g_idx = (torch.arange(k) + _k_start(layer)) // gs
        return gptq_grouped(t["qweight"], t["qzeros"], t["scales"], g_idx, self.qcfg.bits,
                            self.qcfg.group_size, self.qcfg.zeros_minus_one)


class AwqWeights(GptqWeights):
    def grouped_weight(self, layer: Linear) -> GroupedWeight:
        t = _take_params(layer)
        return awq_grouped(t["qweight"], t["qzeros"], t["scales"], self.qcfg.group_size,
                           _k_start(layer))


def _take_params(layer: Linear) -> dict[str, torch.Tensor]:
    """The layer's checkpoint tensors, removed from its parameters (the method's form replaces
    them)."""
    return {name: layer._parameters.pop(name).detach() for name in PARAMS
            if name in layer._parameters}


def _k_start(layer: Linear) -> int:
    """The first input column this rank holds (row-parallel layers hold a slice of K)."""
    return getattr(layer, "tp_rank", 0) * layer.in_features if hasattr(
        layer, "full_in_features") else 0


def prepare_params(model: nn.Module, targets: list[tuple[str, int | None, TensorHeader]],
                   qcfg: QuantConfig) -> int:
    """Give every layer the checkpoint stores as GPTQ/AWQ its packed parameters (meta device)
    in place of the float weight. `targets`: (model parameter name, fused shard id, header) for
    every checkpoint tensor. Returns how many layers are stored quantized."""
    layers: dict[str, Linear] = {}
    for pname, _, _header in targets:
        module_name, _, param_name = pname.rpartition(".")
        if param_name != "qweight":
            continue
        try:
            layer = model.get_submodule(module_name)
        except AttributeError:
            continue  # the loader reports the tensor as unexpected
        if isinstance(layer, Linear):
            layers[module_name] = layer
    has_g_idx = {pname.rpartition(".")[0] for pname, _, _ in targets if pname.endswith(".g_idx")}
    for module_name, layer in layers.items():
        _register(layer, qcfg, module_name in has_g_idx, module_name)
    return len(layers)


def _register(layer: Linear, qcfg: QuantConfig, has_g_idx: bool, name: str) -> None:
    pf = 32 // qcfg.bits
    n, k = layer.out_features, layer.in_features
    num_shards = len(getattr(layer, "output_sizes", ())) or 1
    full_k = getattr(layer, "full_in_features", k)
    gs = qcfg.group_size if qcfg.group_size > 0 else full_k
    groups = -(-full_k // gs)
    if qcfg.scheme == "gptq":
        shapes = {"qweight": (k // pf, n), "qzeros": (groups, n // pf), "scales": (groups, n)}
        packed_n = "qzeros"
        if k % pf:
            raise ValueError(f"{name}: {k} input columns per rank are not a whole number of "
                             f"{qcfg.bits}-bit words ({pf} values)")
        if has_g_idx:
            shapes["g_idx"] = (num_shards * k,)
    else:
        shapes = {"qweight": (k, n // 8), "qzeros": (groups, n // 8), "scales": (groups, n)}
        packed_n = "qweight"
    sizes = getattr(layer, "local_sizes", [n])
    if any(size % pf for size in sizes):
        raise ValueError(f"{name}: {sizes} output rows per rank are not whole {qcfg.bits}-bit "
                         f"words of {packed_n} ({pf} values); use a tensor-parallel size that "
                         "keeps them whole")
    plain = layer._parameters.pop("weight")
    layer.weight = torch.empty(0, dtype=plain.dtype, device="meta")  # released: no float form
    for pname, shape in shapes.items():
        dtype = torch.float32 if pname == "scales" else torch.int32
        layer.register_parameter(pname, nn.Parameter(torch.empty(shape, dtype=dtype,
                                                                 device="meta"),
                                                     requires_grad=False))
    layer.quant_params = tuple(shapes)
    layer.quant_shard = lambda param_name, shard_id: _shard(layer, qcfg, param_name, shard_id)


def _shard(layer: Linear, qcfg: QuantConfig, param_name: str,
           shard_id: int | None) -> WeightShard:
    """What this rank reads of one packed checkpoint tensor (see the module docstring)."""
    pf = 32 // qcfg.bits
    describe = getattr(layer, "weight_shard", None)
    if describe is None:  # not a parallel layer: the layer's own shape is the full one
        ws = WeightShard((layer.out_features, layer.in_features), 0, 0, layer.out_features)
    else:
        ws = describe("weight", shard_id)
    full_n, full_k = ws.full_shape
    gs = qcfg.group_size if qcfg.group_size > 0 else full_k
    groups = -(-full_k // gs)
    gptq = qcfg.scheme == "gptq"
    if ws.dim == 1:  # row-parallel: rows of K
        start, size = ws.start, ws.size
        if param_name == "qweight":
            if gptq:
                return WeightShard((full_k // pf, full_n), 0, start // pf, size // pf)
            return WeightShard((full_k, full_n // 8), 0, start, size)
        if param_name == "g_idx":
            return WeightShard((full_k,), 0, start, size)
        packed = param_name == "qzeros"
        return WeightShard((groups, full_n // pf if packed else full_n))
    start, size, dest = ws.start, ws.size, ws.dest_start  # columns of N
    if param_name == "g_idx":
        k = layer.in_features
        return WeightShard((full_k,), 0, 0, k, (shard_id or 0) * k)
    if param_name == "scales":
        return WeightShard((groups, full_n), 1, start, size, dest)
    if param_name == "qzeros" or not gptq:  # N packed in words
        rows = groups if param_name == "qzeros" else full_k
        return WeightShard((rows, full_n // pf), 1, start // pf, size // pf, dest // pf)
    return WeightShard((full_k // pf, full_n), 1, start, size, dest)
