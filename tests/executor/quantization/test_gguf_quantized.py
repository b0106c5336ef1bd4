"""GGUF files whose linear weights, embedding and LM head (tied or not) stay quantized: the
converted directory holds their raw blocks, and the model loaded from it equals the same file
fully dequantized (by the `gguf` package, the independent reference) in logits and greedy
tokens, for every kept type, at TP = 1 and 2, in less memory; every malformed or unsplittable
case is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints.files import CheckpointError
from checkpoints.gguf import gguf_checkpoint_dir
from checkpoints.gguf.dequantize import dequantized_copy
from checkpoints.quant_config import (
    GGUF_TYPES,
    checkpoint_quant_config,
    resolve_quant_config,
)
from executor_svc.loading.loader import load_model, model_weight_bytes
from executor_svc.quantization.gguf_blocks import BLOCK_TYPES
from executor_svc.quantization.gguf_loading import GgufWeights, TiedGgufWeights
from tests.executor.parallel.test_tp_model import greedy_run
from tests.fixtures.gguf_files import gguf_tensor_name, make_gguf, write_gguf

gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# K-quants need rows of 256 inputs; the gguf package cannot quantize them, so their blocks are
# random bytes with small fp16 scales (offsets of d, dmin / d in each block). Q6_K files hold
# their embedding (and untied head) as Q6_K too; Q4_K files keep them F32 (not kept quantized).
K_QUANT_DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2)
_K_SCALES = {"Q4_K": (0, 2), "Q6_K": (208,)}


def _random_k_blocks(kind_name: str, seed: int):
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[kind_name]

    def encode(name: str, values: np.ndarray):
        if values.ndim != 2 or (kind_name == "Q4_K" and not name.startswith("blk.")):
            return None  # as write_gguf's default type (F32)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        rows, num_blocks = values.shape[0], values.shape[1] // block
        data = rng.integers(0, 256, (rows, num_blocks, size), dtype=np.uint8)
        for offset in _K_SCALES[kind_name]:
            scales = rng.uniform(2e-5, 2e-4, (rows, num_blocks)).astype(np.float16)
            data[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, num_blocks, 2)
        return data.reshape(rows, num_blocks * size), kind

    return encode


def build_gguf(arch: str, kind: str, root: Path) -> Path:
    """A tiny `arch` model as a GGUF whose linear weights are `kind`."""
    if kind not in _K_SCALES:
        return make_gguf(arch, kind, root)[1]
    hf_dir, _ = make_gguf(arch, "F32", root, **K_QUANT_DIMS)
    return write_gguf(hf_dir, root / f"tiny-{arch}.{kind}.gguf", "F32",
                      encode=_random_k_blocks(kind, seed=len(kind)))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(arch, kind) -> (GGUF file, converted dir, its dequantized copy), built once."""
    built: dict[tuple[str, str], tuple[Path, Path, Path]] = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in built:
            root = tmp_path_factory.mktemp(f"{arch}-{kind}")
            gguf_file = build_gguf(arch, kind, root)
            model_dir = gguf_checkpoint_dir(gguf_file, root / "cache")
            built[arch, kind] = (gguf_file, model_dir,
                                 dequantized_copy(model_dir, root / "dequantized"))
        return built[arch, kind]

    return get


def _load(model_dir: Path, quantization: str | None = None):
    return load_model(model_dir, dtype=torch.float32, device=CPU, max_model_len=64,
                      quantization=quantization)


# llama2 unties its head, llama3 and qwen2 tie it.
CASES = ([("llama2", kind) for kind in GGUF_TYPES]
         + [("qwen2", "Q8_0"), ("qwen2", "Q6_K"), ("llama3", "Q4_0"), ("llama3", "Q4_1")])
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _vocab_kept(kind: str) -> bool:
    """Whether build_gguf's file stores the embedding (and untied head) as `kind`."""
    return kind != "Q4_K"


def test_kept_types_agree():
    assert tuple(BLOCK_TYPES) == GGUF_TYPES


@pytest.mark.parametrize("arch, kind", CASES)
def test_converted_directory_holds_raw_blocks(arch, kind, converted):
    from safetensors.numpy import load_file

    gguf_file, model_dir, _ = converted(arch, kind)
    config = json.loads((model_dir / "config.json").read_text())
    types = config["quantization_config"]["tensor_types"]
    assert config["quantization_config"]["quant_method"] == "gguf"
    layers = config["num_hidden_layers"]
    expected = {f"model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.weight": kind
                for i in range(layers) for p in LINEARS}
    if _vocab_kept(kind):
        expected["model.embed_tokens.weight"] = kind
        if not config["tie_word_embeddings"]:
            expected["lm_head.weight"] = kind
    assert types == expected
    weights = load_file(str(model_dir / "model.safetensors"))
    file_tensors = {t.name: t for t in gguf.GGUFReader(gguf_file).tensors}
    elems, size = BLOCK_TYPES[kind]
    for name, values in weights.items():
        if name not in types:
            assert values.dtype in (np.float32, np.float16), name
            continue
        tensor = file_tensors[gguf_tensor_name(name)]
        k = int(tensor.shape[0])
        assert values.dtype == np.uint8 and values.shape == (int(tensor.shape[1]),
                                                             k // elems * size), name
        stored = np.asarray(tensor.data).reshape(values.shape)
        if arch.startswith("llama") and (".q_proj." in name or ".k_proj." in name):
            # llama.cpp's rotary permutation undone: the same rows, another order
            assert sorted(map(bytes, values)) == sorted(map(bytes, stored)), name
        else:
            assert np.array_equal(values, stored), name  # the file's bytes, untouched


@pytest.mark.parametrize("arch, kind", CASES)
def test_kept_quantized_model_equals_the_dequantized_one(arch, kind, converted):
    _, model_dir, dequantized = converted(arch, kind)
    got, expected = greedy_run(model_dir), greedy_run(dequantized)
    assert got["tokens"] == expected["tokens"]
    for step, (a, b) in enumerate(zip(got["logits"], expected["logits"], strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, s=step: f"{s}: {m}")
    # The flag may name the checkpoint's own scheme.
    assert greedy_run(model_dir, quantization="gguf")["tokens"] == got["tokens"]


@pytest.mark.parametrize("arch, kind", [("llama2", kind) for kind in GGUF_TYPES]
                         + [("llama3", "Q4_1"), ("qwen2", "Q6_K")])
def test_weight_bytes_smaller(arch, kind, converted):
    _, model_dir, dequantized = converted(arch, kind)
    ours, plain = _load(model_dir), _load(dequantized)
    projections = [m for n, m in ours.named_modules() if n.endswith(
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    assert projections and all(isinstance(m.method, GgufWeights) and m.gguf_type == kind
                               and m.weight.numel() == 0 for m in projections)
    linear = sum(p.numel() for n, p in plain.named_parameters() if n.rsplit(".", 2)[-2]
                 in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    embedding, head = ours.model.embed_tokens, ours.lm_head
    tied = ours.cfg.tie_word_embeddings
    vocab = 0
    if _vocab_kept(kind):
        vocab = embedding.num_embeddings * embedding.embedding_dim
        assert embedding.gguf_type == kind and embedding.weight.dtype == torch.uint8
        if tied:  # the grouped form of the embedding's rows, which stay for lookups
            assert isinstance(head.method, TiedGgufWeights)
            assert embedding.weight.shape == (vocab // embedding.embedding_dim,
                                              BLOCK_TYPES[kind][1] * embedding.embedding_dim
                                              // BLOCK_TYPES[kind][0])
        else:
            assert isinstance(head.method, GgufWeights) and head.weight.numel() == 0
    else:
        assert embedding.gguf_type is None and embedding.weight.dtype == torch.float32
    saved = model_weight_bytes(plain) - model_weight_bytes(ours)
    # fp32 linears (4 bytes per weight, twice where the CPU backend keeps two packed forms)
    # against at most 1 byte per weight plus fp32 scales and offsets per group (Q6_K: 16
    # inputs, 0.25 B). The embedding (4 B per weight) and an untied head (4 B more) against
    # the raw rows (at most 34 / 32 B) plus the head's grouped form (at most 1.5 B).
    per_vocab_weight = (4 if tied else 8) - 34 / 32 - 1.5
    assert saved >= linear * (4 - 1 - 8 / 16) + vocab * per_vocab_weight, (saved, linear, vocab)


def _tp2_rank(rank: int, model_dir: str, out_dir: str) -> None:
    result = greedy_run(Path(model_dir))
    if rank == 0:
        torch.save(result, Path(out_dir) / "tp2.pt")


@pytest.mark.parametrize("arch, kind", [("llama2", "Q4_1"), ("llama2", "Q8_0"),
                                        ("llama3", "Q4_0")])
def test_tp2_equals_tp1(arch, kind, converted, tmp_path):
    """Column-parallel layers split raw rows, row-parallel ones whole blocks of each row, the
    embedding and LM head (tied in llama3) vocab ranges of whole rows."""
    from tests.executor.parallel.tp_procs import run_ranks

    _, model_dir, _ = converted(arch, kind)
    expected = greedy_run(model_dir)
    run_ranks(_tp2_rank, 2, str(model_dir), str(tmp_path))
    got = torch.load(tmp_path / "tp2.pt")
    assert got["tokens"] == expected["tokens"]
    for a, b in zip(got["logits"], expected["logits"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _split_refusal_rank(rank: int, model_dir: str) -> None:
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2: model\.layers\.0\.self_attn"
                                         r"\.o_proj is stored as Q4_K blocks of 256 inputs, and "
                                         r"splitting its 256 inputs over 2 ranks leaves 128"):
        _load(Path(model_dir))


def test_row_parallel_split_inside_a_block_is_refused(converted):
    from tests.executor.parallel.tp_procs import run_ranks

    _, model_dir, _ = converted("llama2", "Q4_K")
    run_ranks(_split_refusal_rank, 2, str(model_dir))


_SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(GGUF_TYPES), seed=st.integers(0, 2**32 - 1),
       ids=st.lists(st.integers(0, 6), min_size=1, max_size=9))
def test_embedding_lookup_dequantizes_the_rows_it_gathers(kind, seed, ids):
    """Any block bytes (finite fp16 scales) and ids: the rows `gguf` dequantizes, exactly."""
    from torch import nn

    from executor_svc.models.parallel import VocabParallelEmbedding

    elems, size = BLOCK_TYPES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (7, 2, size), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[kind]:
        scales = rng.uniform(-2.0, 2.0, (7, 2)).astype(np.float16)
        blocks[..., offset:offset + 2] = scales.view(np.uint8).reshape(7, 2, 2)
    raw = blocks.reshape(7, 2 * size)
    embedding = VocabParallelEmbedding(7, 2 * elems, torch.float32)
    embedding.gguf_type = kind
    embedding.weight = nn.Parameter(torch.from_numpy(raw), requires_grad=False)
    got = embedding(torch.tensor(ids))
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])[ids]
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(expected))


def _edited(model_dir: Path, dest: Path, edit) -> Path:
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    edit(config["quantization_config"]["tensor_types"], config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_refusals(converted, tmp_path):
    _, model_dir, dequantized = converted("llama2", "Q8_0")
    layer0 = "model.layers.0.self_attn."
    cases = [
        (lambda t, c: t.pop(layer0 + "o_proj.weight"),
         r"tensor model\.layers\.0\.self_attn\.o_proj\.weight is U8 but config\.json's "
         r"quantization_config\.tensor_types does not list it"),
        (lambda t, c: t.pop(layer0 + "k_proj.weight"),
         r"fused into model\.layers\.0\.self_attn\.qkv_proj must all be GGUF blocks of one "
         r"type, got \['Q8_0', 'Q8_0'\] for 3 shards"),
        (lambda t, c: t.update({"model.norm.weight": "Q8_0"}),
         r"lists model\.norm\.weight, which is not the weight of a projection, the "
         r"embedding or the LM head"),
        (lambda t, c: t.pop("model.embed_tokens.weight"),
         r"tensor model\.embed_tokens\.weight is U8 but config\.json's "
         r"quantization_config\.tensor_types does not list it"),
        (lambda t, c: t.update({"model.layers.9.mlp.up_proj.weight": "Q8_0"}),
         r"lists tensors the checkpoint lacks: model\.layers\.9\.mlp\.up_proj\.weight"),
        (lambda t, c: t.update({layer0 + "k_proj.weight": "Q4_0"}),
         r"fused into model\.layers\.0\.self_attn\.qkv_proj must all be GGUF blocks of one "
         r"type, got \['Q4_0', 'Q8_0', 'Q8_0'\]"),
        (lambda t, c: t.update({layer0 + "k_proj.weight": "Q5_0"}),
         r"tensor_types\['model\.layers\.0\.self_attn\.k_proj\.weight'\] = 'Q5_0'"),
        (lambda t, c: c["quantization_config"].update(tensor_types=[]),
         r"tensor_types must be a non-empty object"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message):
            _load(_edited(model_dir, tmp_path / str(i), edit))
    # A float tensor listed as blocks.
    config = json.loads((dequantized / "config.json").read_text())
    bad = tmp_path / "float_listed"
    shutil.copytree(dequantized, bad)
    config["quantization_config"] = {"quant_method": "gguf",
                                     "tensor_types": {layer0 + "o_proj.weight": "Q8_0"}}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.self_attn\.o_proj\."
                                              r"weight has dtype F32, but quantization_config"):
        _load(bad)
    # Flags: another scheme on a GGUF checkpoint, gguf on a float one.
    with pytest.raises(ValueError, match=r"--quantization int8 disagrees with the checkpoint, "
                                         r"whose config\.json declares gguf"):
        resolve_quant_config("int8", model_dir)
    with pytest.raises(ValueError, match=r"--quantization gguf loads the block-quantized "
                                         r"weights of a converted GGUF file"):
        resolve_quant_config("gguf", dequantized)


@settings(max_examples=200, deadline=None)
@given(types=st.one_of(st.none(), st.integers(), st.lists(st.text(max_size=4), max_size=2),
                       st.dictionaries(st.text(max_size=8),
                                       st.sampled_from([*GGUF_TYPES, "Q5_0", "F32", 3, None]),
                                       max_size=3)))
def test_gguf_quantization_config_fuzz(types):
    """Any tensor_types is a gguf scheme Folio loads or a ValueError naming the field."""
    try:
        got = checkpoint_quant_config({"quantization_config": {"quant_method": "gguf",
                                                               "tensor_types": types}})
    except ValueError as e:
        assert "quantization_config.tensor_types" in str(e), e
    else:
        assert got.scheme == "gguf" and got.from_checkpoint and got.tensor_types == types
        assert types and set(types.values()) <= set(GGUF_TYPES)
