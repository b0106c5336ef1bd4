"""Each tensor-parallel layer against its unsharded nn.Linear / nn.Embedding, at TP = 2 over
gloo, loaded through the loader's per-parameter shards, with plain F.linear and with the CPU
packed linear method on the rank's shard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from checkpoints.files import read_weight_headers
from executor_svc.loading.loader import load_weights, plan_weights
from executor_svc.loading.model_config import ModelConfig, check_tensor_parallel, local_kv_heads
from executor_svc.models.linear import PackedCpuLinear, use_linear_method
from executor_svc.models.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TiedParallelLMHead,
    VocabParallelEmbedding,
    kv_head_start,
    vocab_range,
)
from executor_svc.parallel import distributed
from tests.executor.parallel.tp_procs import run_ranks

HIDDEN, HEAD_DIM, NUM_HEADS, INTER, COLS, VOCAB = 16, 4, 4, 24, 10, 13  # 13: a padded range


class Layers(nn.Module):
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                      "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, num_kv_heads: int):
        super().__init__()
        dtype = torch.float32
        self.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, num_kv_heads, True, dtype)
        self.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], True, dtype)
        self.col = ColumnParallelLinear(HIDDEN, COLS, True, dtype)
        self.down_proj = RowParallelLinear(INTER, HIDDEN, True, dtype)
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, dtype)
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN, dtype)


def _checkpoint(path: Path, num_kv_heads: int) -> Path:
    gen = torch.Generator().manual_seed(num_kv_heads)
    shapes = {"q_proj": (NUM_HEADS * HEAD_DIM, HIDDEN), "k_proj": (num_kv_heads * HEAD_DIM, HIDDEN),
              "v_proj": (num_kv_heads * HEAD_DIM, HIDDEN), "gate_proj": (INTER, HIDDEN),
              "up_proj": (INTER, HIDDEN), "col": (COLS, HIDDEN), "down_proj": (HIDDEN, INTER)}
    tensors = {}
    for name, shape in shapes.items():
        tensors[f"{name}.weight"] = torch.randn(shape, generator=gen)
        tensors[f"{name}.bias"] = torch.randn(shape[0], generator=gen)
    tensors["embed.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen)
    tensors["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen)
    save_file(tensors, str(path))
    return path


def _load(file: Path, num_kv_heads: int) -> Layers:
    with torch.device("meta"):
        layers = Layers(num_kv_heads)
    placements = plan_weights(layers, read_weight_headers([file]), tie_word_embeddings=False)
    layers.to_empty(device="cpu")
    load_weights(layers, placements)
    return layers


def _check_layers(layers: Layers, ref: dict[str, torch.Tensor], rank: int, tp: int,
                  num_kv_heads: int) -> None:
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(7))

    def full(name: str, inp: torch.Tensor) -> torch.Tensor:
        return F.linear(inp, ref[f"{name}.weight"], ref[f"{name}.bias"])

    def cols(y: torch.Tensor, start: int, size: int) -> torch.Tensor:
        return y[:, start:start + size]

    with torch.no_grad():
        # Column: this rank's output columns.
        n = COLS // tp
        torch.testing.assert_close(layers.col(x), cols(full("col", x), rank * n, n))
        # gate|up: each projection's columns of this rank, stacked.
        m = INTER // tp
        expected = torch.cat([cols(full("gate_proj", x), rank * m, m),
                              cols(full("up_proj", x), rank * m, m)], dim=1)
        gate_up = layers.gate_up_proj(x)
        torch.testing.assert_close(gate_up, expected)
        # q|k|v: this rank's q heads, and the KV heads they attend with.
        qkv = layers.qkv_proj
        lq, lkv = NUM_HEADS // tp, max(1, num_kv_heads // tp)
        kv0 = kv_head_start(num_kv_heads, tp, rank)
        expected = torch.cat([cols(full("q_proj", x), rank * lq * HEAD_DIM, lq * HEAD_DIM),
                              cols(full("k_proj", x), kv0 * HEAD_DIM, lkv * HEAD_DIM),
                              cols(full("v_proj", x), kv0 * HEAD_DIM, lkv * HEAD_DIM)], dim=1)
        torch.testing.assert_close(qkv(x), expected)
        assert (qkv.num_local_heads, qkv.num_local_kv_heads) == (lq, lkv)
        # GQA: local q head i attends with local KV head i // (lq / lkv); globally that must be
        # the KV head of its global q head (group of NUM_HEADS / num_kv_heads q heads).
        for i in range(lq):
            assert kv0 + i // (lq // lkv) == (rank * lq + i) // (NUM_HEADS // num_kv_heads)
        # Row: the rank's slice of the input in, the whole reduced output (bias once) out.
        h = torch.randn(5, INTER, generator=torch.Generator().manual_seed(8))
        torch.testing.assert_close(layers.down_proj(h[:, rank * m:(rank + 1) * m]),
                                   full("down_proj", h))
        # Embedding: every id of the vocab, whichever rank holds it; padding rows are zero.
        ids = torch.arange(VOCAB).flip(0)
        torch.testing.assert_close(layers.embed(ids), F.embedding(ids, ref["embed.weight"]))
        held = layers.embed.vocab_end - layers.embed.vocab_start
        assert not layers.embed.weight[held:].any()
        # LM heads: rank 0 gets the whole vocab's logits, the others None.
        for head, weight in ((layers.lm_head, ref["lm_head.weight"]),
                             (TiedParallelLMHead(layers.embed), ref["embed.weight"])):
            logits = head(x)
            if rank == 0:
                torch.testing.assert_close(logits, x @ weight.t())
            else:
                assert logits is None


def _layers_rank(rank: int, files: dict[int, str]) -> None:
    tp = distributed.tp_size()
    for num_kv_heads, file in files.items():  # KV heads split (2) and replicated (1)
        ref = load_file(file)
        layers = _load(Path(file), num_kv_heads)
        _check_layers(layers, ref, rank, tp, num_kv_heads)
        # The CPU packed method works on each rank's shard (the bias passed or withheld).
        use_linear_method(layers, PackedCpuLinear(release_plain=False))
        _check_layers(layers, ref, rank, tp, num_kv_heads)


def test_parallel_layers_match_unsharded_at_tp2(tmp_path):
    files = {kv: str(_checkpoint(tmp_path / f"kv{kv}.safetensors", kv)) for kv in (2, 1)}
    run_ranks(_layers_rank, 2, files)


def test_single_rank_layers_are_the_plain_layers(tmp_path):
    """Without a group every parallel layer holds the whole matrix and computes the same."""
    file = _checkpoint(tmp_path / "kv2.safetensors", 2)
    ref = load_file(str(file))
    layers = _load(file, 2)
    assert layers.qkv_proj.weight.shape == (NUM_HEADS * HEAD_DIM + 2 * 2 * HEAD_DIM, HIDDEN)
    assert layers.embed.weight.shape == (VOCAB, HIDDEN)
    _check_layers(layers, ref, 0, 1, 2)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(num_kv_heads=st.integers(1, 16), group=st.integers(1, 8),
       tp=st.sampled_from([1, 2, 3, 4, 6, 8, 16]), intermediate_size=st.integers(1, 64),
       vocab_size=st.integers(1, 1000))
def test_every_split_is_refused_or_consistent(num_kv_heads, group, tp, intermediate_size,
                                              vocab_size):
    """Any shape and size: either a refusal naming the flag, or a layout where every rank's
    q heads attend with the KV heads of their groups and the vocab ranges tile the vocab."""
    num_heads = num_kv_heads * group
    cfg = ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=vocab_size, hidden_size=2 * num_heads,
        intermediate_size=intermediate_size, num_hidden_layers=1,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads))
    splittable = not (num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads)
                      or intermediate_size % tp)
    if not splittable:
        with pytest.raises(ValueError, match=f"--tensor-parallel-size {tp}"):
            check_tensor_parallel(cfg, tp)
        return
    check_tensor_parallel(cfg, tp)
    lq, lkv = num_heads // tp, local_kv_heads(cfg, tp)
    assert lq % lkv == 0
    for rank in range(tp):
        kv0 = kv_head_start(num_kv_heads, tp, rank)
        assert 0 <= kv0 and kv0 + lkv <= num_kv_heads
        for i in range(lq):
            assert kv0 + i // (lq // lkv) == (rank * lq + i) // group
    ids: list[int] = []
    for rank in range(tp):
        per_rank, start, end = vocab_range(vocab_size, tp, rank)
        assert 0 <= end - start <= per_rank
        ids.extend(range(start, end))
    assert ids == list(range(vocab_size))
