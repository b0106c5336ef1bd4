"""Tensor-parallel layers: each rank holds one shard of every large matrix.

Rank layout with ``tp`` ranks (rank r), as in Megatron-LM:

    ColumnParallelLinear     output rows split:  rank r computes y[:, r*n/tp : (r+1)*n/tp]
    MergedColumnParallel     gate|up: each stacked projection split the same way
    QKVParallelLinear        q heads split; KV heads split when num_kv_heads >= tp, else
                             replicated (rank r holds KV head r * num_kv_heads // tp)
    RowParallelLinear        input columns split; partial products summed by all_reduce,
                             the bias added once after the sum
    VocabParallelEmbedding   rows split in contiguous ranges of ceil(vocab / tp); ids of
                             another rank's range look up zeros, then all_reduce
    ParallelLMHead           the same vocab ranges; logits gathered on rank 0 only

A column-parallel layer feeding a row-parallel one (qkv -> o_proj, gate_up -> down) needs no
communication in between: one all_reduce per attention block and one per MLP.

Weight loading is described per parameter: ``layer.weight_shard(param_name, shard_id)`` says
which slice of which checkpoint tensor this rank reads and where it lands (`WeightShard`); the
loader (executor_svc/loading/loader.py) reads only that slice. Every layer stays a `Linear`, so
``Linear.method`` (CPU packing now, quantized methods later) applies to the rank's shard as
is; a quantized layer's extra parameters (scales, packed ints) describe their own shards
through the same method. With one rank every layer is the plain layer it replaces.

A fused layer's parts may also come from one checkpoint tensor that already stacks them (Phi-3
stores ``qkv_proj`` and ``gate_up_proj`` so): `prefused_shard` moves each part's shard down by
the rows of the parts before it, so every rank still reads only its own rows of each part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.models.linear import Linear, TiedHead
from executor_svc.parallel import distributed
from executor_svc.quantization.gguf_blocks import unpack_blocks


@dataclass(frozen=True)
class WeightShard:
    """What this rank reads of one checkpoint tensor, and where it goes in a parameter.

    `full_shape` is the whole checkpoint tensor's shape (the header is checked against it).
    `dim` None: the tensor is read whole into the whole parameter (replicated). Otherwise the
    rank reads ``[start, start + size)`` along `dim` into ``[dest_start, dest_start + size)``
    along the same dim of the parameter; rows of an unfused parameter past `size` (the padding
    of the last vocab range) are zeroed. `dest_index` (with `dim` None): the one-element
    tensor goes to that element of the parameter (a fused layer's per-shard scale). `expert`:
    the checkpoint tensor is one expert's, placed in ``param[expert]`` (models/moe.py's
    stacked experts); `dim` and `dest_start` then refer to that expert's slice."""

    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    size: int = 0
    dest_start: int = 0
    dest_index: int | None = None
    expert: int | None = None


def replicated(param: torch.Tensor) -> WeightShard:
    return WeightShard(tuple(param.shape))


def _split(full_shape: tuple[int, ...], dim: int, start: int, size: int,
           dest_start: int = 0) -> WeightShard:
    return WeightShard(full_shape, dim, start, size, dest_start)


class ColumnParallelLinear(Linear):
    """y = x W^T + b with W's output rows (and b) split across the ranks; each rank returns
    its own columns of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        self.tp_size, self.tp_rank = distributed.tp_size(), distributed.tp_rank()
        assert out_features % self.tp_size == 0, "checked by check_tensor_parallel"
        super().__init__(in_features, out_features // self.tp_size, bias=bias, dtype=dtype)
        self.full_out_features = out_features

    def weight_shard(self, param_name: str, shard_id: int | None) -> WeightShard:
        local = self.out_features
        return _split((self.full_out_features, self.in_features)[:self._ndim(param_name)], 0,
                      self.tp_rank * local, local)

    @staticmethod
    def _ndim(param_name: str) -> int:
        return 1 if param_name == "bias" else 2


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several checkpoint projections stacked along the output rows in one matmul (gate|up),
    each split across the ranks. `output_sizes` are the full checkpoint sizes; shard i of this
    rank fills rows ``sum(local_sizes[:i]) : sum(local_sizes[:i + 1])``."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype):
        super().__init__(in_features, sum(output_sizes), bias, dtype)
        self.output_sizes = list(output_sizes)
        self.local_sizes = [size // self.tp_size for size in output_sizes]

    def weight_shard(self, param_name: str, shard_id: int | None) -> WeightShard:
        assert shard_id is not None, "a merged layer is filled shard by shard"
        local = self.local_sizes[shard_id]
        full = (self.output_sizes[shard_id], self.in_features)[:self._ndim(param_name)]
        return _split(full, 0, self.tp_rank * local, local, sum(self.local_sizes[:shard_id]))


def prefused_shard(layer: nn.Module, shard: WeightShard, shard_id: int) -> WeightShard:
    """Part `shard_id`'s `shard` (as read from a checkpoint tensor of that part alone) read
    from a tensor holding all of the fused `layer`'s parts stacked along dim 0 instead:
    ValueError for a shard that is not a slice of rows (a per-part scale has no rows to move)."""
    sizes = layer.output_sizes
    if shard.dim != 0 or shard.full_shape[0] != sizes[shard_id]:
        raise ValueError("only row slices of a fused tensor can be read from one checkpoint "
                         "tensor that stacks its parts")
    offset = sum(sizes[:shard_id])
    return dataclasses.replace(shard, full_shape=(sum(sizes), *shard.full_shape[1:]),
                               start=shard.start + offset)


def kv_head_start(num_kv_heads: int, tp_size: int, tp_rank: int) -> int:
    """The first KV head rank `tp_rank` holds. Split (num_kv_heads >= tp): its own block of
    num_kv_heads / tp heads. Replicated (fewer KV heads than ranks, tp % num_kv_heads == 0):
    rank r's q heads [r * H/tp, (r+1) * H/tp) all lie in the group of KV head
    r * num_kv_heads // tp, because a group (H / num_kv_heads q heads) spans tp / num_kv_heads
    whole ranks."""
    if num_kv_heads >= tp_size:
        return tp_rank * (num_kv_heads // tp_size)
    return tp_rank * num_kv_heads // tp_size


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v for this rank's heads: num_heads / tp q heads and `num_local_kv_heads` KV heads
    (shards 0, 1, 2 as the checkpoint's q_proj, k_proj, v_proj)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype):
        tp = distributed.tp_size()
        self.num_local_heads = num_heads // tp
        self.num_local_kv_heads = max(1, num_kv_heads // tp)
        self.head_dim = head_dim
        self.output_sizes = [num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim]
        self.local_sizes = [self.num_local_heads * head_dim,
                            self.num_local_kv_heads * head_dim,
                            self.num_local_kv_heads * head_dim]
        # The layer's own rows are the local ones; ColumnParallelLinear divides by tp.
        super().__init__(hidden_size, sum(self.local_sizes) * tp, bias, dtype)
        self.full_out_features = sum(self.output_sizes)
        self.kv_head_start = kv_head_start(num_kv_heads, tp, self.tp_rank)

    def weight_shard(self, param_name: str, shard_id: int | None) -> WeightShard:
        assert shard_id is not None, "q|k|v is filled shard by shard"
        full = (self.output_sizes[shard_id], self.in_features)[:self._ndim(param_name)]
        if shard_id == 0:
            start = self.tp_rank * self.local_sizes[0]
        else:
            start = self.kv_head_start * self.head_dim
        return _split(full, 0, start, self.local_sizes[shard_id],
                      sum(self.local_sizes[:shard_id]))


class RowParallelLinear(Linear):
    """y = x W^T + b with W's input columns split: each rank multiplies its slice of x (the
    column-parallel layer before it left exactly that slice there) and the partial products
    are summed over the ranks. The bias is replicated and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        self.tp_size, self.tp_rank = distributed.tp_size(), distributed.tp_rank()
        assert in_features % self.tp_size == 0, "checked by check_tensor_parallel"
        super().__init__(in_features // self.tp_size, out_features, bias=bias, dtype=dtype)
        self.full_in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.method.apply(self, x, self.bias)
        out = distributed.all_reduce(self.method.apply(self, x, None))  # [num_tokens, out]
        return out if self.bias is None else out + self.bias

    def weight_shard(self, param_name: str, shard_id: int | None) -> WeightShard:
        if param_name == "bias":
            return WeightShard((self.out_features,))
        local = self.in_features
        return _split((self.out_features, self.full_in_features), 1, self.tp_rank * local,
                      local)


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(rows per rank, first id, end id) of rank `tp_rank`'s contiguous vocab range:
    ceil(vocab / tp) rows each, the last range short (possibly empty) and padded."""
    per_rank = -(-vocab_size // tp_size)
    start = min(tp_rank * per_rank, vocab_size)
    return per_rank, start, min(start + per_rank, vocab_size)


class VocabParallelEmbedding(nn.Embedding):
    """Rank r holds rows [vocab_start, vocab_end) in a table of ceil(vocab / tp) rows (padding
    rows are zero). Ids in another rank's range look up zeros here; the all_reduce sums the
    one rank's row that is not zero.

    A converted GGUF file's embedding may stay quantized (quantization/gguf_loading.py):
    ``gguf_type`` is then set and ``weight`` is uint8 [rows, row_bytes], each row whole GGUF
    blocks (all-zero bytes, d = 0, for the padding rows); a lookup dequantizes only the rows
    it gathers, to `out_dtype`."""

    gguf_type: str | None = None

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        self.tp_size, self.tp_rank = distributed.tp_size(), distributed.tp_rank()
        per_rank, self.vocab_start, self.vocab_end = vocab_range(vocab_size, self.tp_size,
                                                                 self.tp_rank)
        super().__init__(per_rank, hidden_size, dtype=dtype)
        self.vocab_size = vocab_size
        self.out_dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        x = self._lookup(local_ids)  # [num_tokens, hidden]
        return distributed.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_type is None:
            return F.embedding(ids, self.weight)
        raw = self.weight.index_select(0, ids.reshape(-1))  # [num_tokens, row_bytes]
        rows = unpack_blocks(raw, self.gguf_type, self.embedding_dim).dequantize()
        return rows.to(self.out_dtype).view(*ids.shape, self.embedding_dim)

    def weight_shard(self, param_name: str, shard_id: int | None) -> WeightShard:
        return _split((self.vocab_size, self.embedding_dim), 0, self.vocab_start,
                      self.vocab_end - self.vocab_start)


def gather_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """[num_logits, ceil(vocab / tp)] per rank -> rank 0: [num_logits, vocab] in id order (the
    ranges are contiguous, so concatenation in rank order is the vocab order, then the padding
    is cut, leaving contiguous rows for the sampler); other ranks: None."""
    logits = distributed.gather_to_first(local_logits, dim=-1)
    if logits is None or logits.shape[-1] == vocab_size:
        return logits
    return logits[:, :vocab_size].contiguous()


class ParallelLMHead(Linear):
    """The untied LM head, vocab-parallel like the embedding. Returns rank 0 the full logits
    and the other ranks None."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        self.tp_size, self.tp_rank = distributed.tp_size(), distributed.tp_rank()
        per_rank, self.vocab_start, self.vocab_end = vocab_range(vocab_size, self.tp_size,
                                                                 self.tp_rank)
        super().__init__(hidden_size, per_rank, bias=False, dtype=dtype)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return gather_logits(self.method.apply(self, x, None), self.vocab_size)

    def weight_shard(self, param_name: str, shard_id: int | None) -> WeightShard:
        return _split((self.vocab_size, self.in_features), 0, self.vocab_start,
                      self.vocab_end - self.vocab_start)


class TiedParallelLMHead(TiedHead):
    """The tied LM head: this rank's embedding shard used as its slice of the head (no
    parameter of its own); logits gathered like `ParallelLMHead`'s."""

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__(embedding)
        self.vocab_size = embedding.vocab_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return gather_logits(self.method.apply(self, x, None), self.vocab_size)  # type: ignore[arg-type]
