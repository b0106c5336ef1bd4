"""GGUF files of mixture-of-experts models: Qwen2-MoE (qwen2moe, with its shared expert),
Qwen3-MoE (qwen3moe) and Mixtral (a llama file with llama.expert_count), written as llama.cpp
writes them (tests/fixtures/gguf_files.py: one merged 3-D tensor per expert projection, an
F32 router), converted by Folio into per-expert HF tensors.

Oracles:
- F32 files: the converted directory is the original checkpoint, every tensor bit for bit and
  the config as Folio reads it;
- qwen2moe / qwen3moe: transformers' own GGUF loading of the same file. It reads neither
  expert_feed_forward_length nor expert_shared_feed_forward_length (its config classes'
  defaults, 1408 / 5632 / 768, come back, and loading fails on the shapes), so it gets the
  original HF config (`config=`) and then loads and dequantizes the file's tensors itself;
- Mixtral: transformers 5.24 cannot load a llama GGUF with experts. Its experts are checked
  against the merged tensors read and sliced here with the gguf package, and the served
  tokens against HF's Mixtral on the float copy of the converted directory.

Experts of a kept block type stay raw like the dense layers (weights.KEEP_EXPERTS_RAW): each
expert's raw rows are the file's bytes, served through one GGUF-block linear per expert and
projection (executor_svc/quantization/experts.py), token for token against the oracles above,
in about a fifth of float32's bytes (Q4_0), and TP = 2 equal to TP = 1. An expert whose gate
and up have different types keeps them float and its down raw: one layer mixes both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints.files import CheckpointError
from checkpoints.gguf import gguf_checkpoint_dir
from checkpoints.gguf import weights as gguf_weights
from checkpoints.gguf.dequantize import dequantized_copy
from executor_svc.loading.model_config import ModelConfig
from scheduler_svc.text.tokenizer import ChatTurn, Tokenizer
from tests.checkpoints.gguf.test_convert import TEXTS, folio_greedy, load_transformers_gguf
from tests.executor.harness import hf_greedy
from tests.fixtures.gguf_files import make_gguf, write_gguf

gguf = pytest.importorskip("gguf")

ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral"]
GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
# Dense layers and experts of different block types, as llama.cpp's mixes write them.
QUANTIZED = {"qwen2_moe": ("Q8_0", "Q4_0"), "qwen3_moe": ("Q4_0", "Q8_0"),
             "mixtral": ("Q8_0", "Q4_0")}
NUM_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    """(arch, dense type, expert type) -> (HF dir, GGUF file, converted dir), once each."""
    built: dict[tuple, tuple] = {}

    def get(arch: str, dense: str = "F32", experts: str | None = None):
        key = (arch, dense, experts or dense)
        if key not in built:
            root = tmp_path_factory.mktemp(f"{arch}-{dense}-{experts}")
            hf_dir, gguf_file = make_gguf(arch, dense, root, expert_type=experts)
            built[key] = (hf_dir, gguf_file, gguf_checkpoint_dir(gguf_file, root / "cache"))
        return built[key]

    return get


def _facts(model_dir) -> ModelConfig:
    return ModelConfig.from_dir(model_dir)


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_file_converts_back_to_the_original_checkpoint(arch, moe_file):
    from safetensors.numpy import load_file

    hf_dir, _, model_dir = moe_file(arch)
    ours, original = _facts(model_dir), _facts(hf_dir)
    assert ours.num_experts and math.isclose(ours.rms_norm_eps, original.rms_norm_eps,
                                             rel_tol=1e-6)  # GGUF holds it as float32
    assert dataclasses.replace(ours, rms_norm_eps=original.rms_norm_eps) == original
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    theirs = load_file(str(hf_dir / "model.safetensors"))
    back = load_file(str(model_dir / "model.safetensors"))
    if original.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert sorted(back) == sorted(theirs)
    for name, values in theirs.items():
        assert back[name].dtype == np.float32 and np.array_equal(back[name], values), name


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_config_agrees_with_transformers_where_it_reads_the_file(arch, moe_file):
    from transformers import AutoConfig

    hf_dir, gguf_file, model_dir = moe_file(arch)
    ours = json.loads((model_dir / "config.json").read_text())
    theirs = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    original = json.loads((hf_dir / "config.json").read_text())
    assert (ours["num_experts"], ours["num_experts_per_tok"], ours["norm_topk_prob"]) == (
        theirs.num_experts, theirs.num_experts_per_tok, theirs.norm_topk_prob)
    # What transformers leaves at its class defaults, the file states:
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in original:
            assert ours[key] == original[key] != getattr(theirs, key), key


def _transformers_expert(state: dict, name: str) -> torch.Tensor:
    """Expert E's projection in transformers' stacked layout: gate_up_proj [E, 2I, hidden]
    (gate rows, then up), down_proj [E, hidden, I]."""
    prefix, expert, proj = name.removesuffix(".weight").rsplit(".", 2)
    e = int(expert)
    if proj == "down_proj":
        return state[f"{prefix}.down_proj"][e]
    gate_up = state[f"{prefix}.gate_up_proj"][e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate_proj" else gate_up[half:]


def _float_tensors(model_dir) -> dict[str, np.ndarray]:
    """The converted tensors as float32, raw block tensors dequantized by the gguf package."""
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    types = config.get("quantization_config", {}).get("tensor_types", {})
    tensors = load_file(str(model_dir / "model.safetensors"))
    return {name: (gguf.quants.dequantize(values, gguf.GGMLQuantizationType[types[name]])
                   if name in types else values).astype(np.float32)
            for name, values in tensors.items()}


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_quantized_tensors_equal_what_transformers_loads(arch, moe_file):
    """Every converted tensor, experts split from the merged ones, equals the parameter
    transformers loads from the same file (dense layers and experts kept raw, dequantized
    here by the gguf package)."""
    hf_dir, gguf_file, model_dir = moe_file(arch, *QUANTIZED[arch])
    types = json.loads((model_dir / "config.json").read_text())["quantization_config"][
        "tensor_types"]
    dense, expert = QUANTIZED[arch]
    assert types["model.layers.0.self_attn.q_proj.weight"] == dense
    assert {kind for n, kind in types.items() if gguf_weights.is_expert(n)} == {expert}
    theirs = load_transformers_gguf(gguf_file, hf_dir).state_dict()
    ours = _float_tensors(model_dir)
    experts = [n for n in ours if gguf_weights.is_expert(n)]
    assert experts and all(n in types for n in experts)
    for name, values in ours.items():
        expected = (_transformers_expert(theirs, name) if name in experts
                    else theirs[name])
        assert torch.equal(torch.from_numpy(values), expected), name


def test_mixtral_experts_are_the_merged_tensors_slices(moe_file):
    """transformers reads no llama file with experts: each converted expert is checked against
    the file's merged tensor, read and sliced here ([experts, rows, cols] once ggml's dims are
    reversed), dequantized by the gguf package."""
    _, gguf_file, model_dir = moe_file("mixtral", *QUANTIZED["mixtral"])
    ours = _float_tensors(model_dir)
    reader = gguf.GGUFReader(gguf_file)
    merged = {t.name: t for t in reader.tensors if "_exps" in t.name}
    assert len(merged) == 3 * 2  # gate, up, down of two layers
    parts = {"gate": "w1", "up": "w3", "down": "w2"}
    for name, tensor in merged.items():
        layer, proj = name.split(".")[1], name.split(".")[2].split("_")[1]
        assert tensor.tensor_type.name == QUANTIZED["mixtral"][1]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert values.shape[0] == 8
        for e in range(8):
            got = ours[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{parts[proj]}.weight"]
            assert np.array_equal(got, values[e]), (name, e)
    router = ours["model.layers.0.block_sparse_moe.gate.weight"]
    assert np.array_equal(router, np.asarray(
        next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_inp.weight").data))


def _prompts(model_dir) -> list[list[int]]:
    tok = Tokenizer(model_dir)
    return [*(tok.encode(t) for t in TEXTS),
            tok.encode_chat([ChatTurn("user", "What is the capital of France?")])]


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_file_served_by_folio_equals_the_oracle(arch, moe_file, tmp_path):
    """Folio's executor on the converted directory (dense layers and experts as GGUF blocks)
    against transformers on the same GGUF (Qwen), or HF's Mixtral on the converted
    directory's float copy."""
    from transformers import AutoModelForCausalLM

    hf_dir, gguf_file, model_dir = moe_file(arch, *QUANTIZED[arch])
    if arch == "mixtral":
        oracle = AutoModelForCausalLM.from_pretrained(
            dequantized_copy(model_dir, tmp_path / "float"), dtype=torch.float32).eval()
    else:
        oracle = load_transformers_gguf(gguf_file, hf_dir)
    prompts = _prompts(model_dir)
    expected = [hf_greedy(oracle, p, NUM_NEW_TOKENS) for p in prompts]
    assert folio_greedy(model_dir, prompts, NUM_NEW_TOKENS) == expected


# K-quants need rows of 256 inputs; the gguf package cannot quantize them, so their blocks are
# random bytes with small fp16 scales d and dmin (bytes 0-3 of each block).
K_DIMS = dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
              intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def _q4_k_experts(seed: int):
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType.Q4_K

    def encode(name: str, values: np.ndarray):
        if values.ndim != 3:
            return None  # the file's type for the rest
        block, size = gguf.GGML_QUANT_SIZES[kind]
        *lead, cols = values.shape
        data = rng.integers(0, 256, (*lead, cols // block, size), dtype=np.uint8)
        scales = rng.uniform(2e-5, 2e-4, (*lead, cols // block, 2)).astype(np.float16)
        data[..., 0:4] = scales.view(np.uint8)
        return data.reshape(*lead, cols // block * size), kind

    return encode


def _loaded_experts(model_dir, **kwargs) -> dict[str, torch.Tensor]:
    """Every expert projection as the loaded model multiplies by it, under the converted
    tensors' names, fp32 [rows, cols]: the dequantized per-expert linears, or the stacked
    float form's slices."""
    from executor_svc.loading.loader import load_model
    from executor_svc.models.moe import Experts
    from executor_svc.quantization.experts import dequantized_experts

    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                       max_model_len=64, keep_plain_weights=True, **kwargs)
    out = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, Experts):
            continue
        assert layer.has_expert_linears, name  # every layer of these files stores them raw
        w13, w2 = dequantized_experts(layer)
        gate, up, down = layer.part_names
        half = w13.shape[1] // 2
        for e in range(layer.num_experts):
            out |= {f"{name}.{e}.{gate}.weight": w13[e, :half],
                    f"{name}.{e}.{up}.weight": w13[e, half:],
                    f"{name}.{e}.{down}.weight": w2[e]}
    return out


def test_raw_expert_rows_are_the_merged_tensors_blocks(tmp_path, monkeypatch):
    """Each expert's raw rows are its slice of the merged tensor's blocks, byte for byte,
    listed with the file's type (Q4_K experts: blocks of 256, Q8_0 dense layers); the loaded
    per-expert linears multiply by what transformers dequantizes from the same file, and the
    served tokens are transformers'. With KEEP_EXPERTS_RAW off the same file's experts are
    float32, equal to the same values."""
    from safetensors.numpy import load_file

    from tests.fixtures.checkpoints import make_checkpoint

    hf_dir = make_checkpoint("qwen2_moe", tmp_path / "hf", **K_DIMS)
    gguf_file = write_gguf(hf_dir, tmp_path / "q4k.gguf", "Q8_0", encode=_q4_k_experts(3))
    reader = gguf.GGUFReader(gguf_file)
    merged = {t.name: t for t in reader.tensors if "_exps" in t.name}
    assert {t.tensor_type.name for t in merged.values()} == {"Q4_K"}

    raw_dir = gguf_checkpoint_dir(gguf_file, tmp_path / "raw-cache")
    types = json.loads((raw_dir / "config.json").read_text())["quantization_config"][
        "tensor_types"]
    tensors = load_file(str(raw_dir / "model.safetensors"))
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    for name, tensor in merged.items():
        layer, proj = name.split(".")[1], name.split(".")[2].split("_")[1]
        stored = np.asarray(tensor.data)  # [experts, rows, row_bytes]
        for e in range(6):
            hf = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
            assert types[hf] == "Q4_K", hf
            cols = 256  # hidden, or the expert's intermediate size: both 256 here
            assert tensors[hf].dtype == np.uint8
            assert tensors[hf].shape == (stored.shape[1], cols // block * size), hf
            assert np.array_equal(tensors[hf], stored[e]), hf
    assert types["model.layers.0.mlp.shared_expert.gate_proj.weight"] == "Q8_0"

    oracle = load_transformers_gguf(gguf_file, hf_dir)
    theirs = oracle.state_dict()
    loaded = _loaded_experts(raw_dir)
    assert len(loaded) == 2 * 6 * 3
    for name, values in loaded.items():
        torch.testing.assert_close(values, _transformers_expert(theirs, name), atol=1e-6,
                                   rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    prompts = _prompts(raw_dir)
    assert folio_greedy(raw_dir, prompts, NUM_NEW_TOKENS) == [
        hf_greedy(oracle, p, NUM_NEW_TOKENS) for p in prompts]

    monkeypatch.setattr(gguf_weights, "KEEP_EXPERTS_RAW", False)
    float_dir = gguf_checkpoint_dir(gguf_file, tmp_path / "float-cache")
    float_types = json.loads((float_dir / "config.json").read_text())["quantization_config"][
        "tensor_types"]
    assert not any(gguf_weights.is_expert(n) for n in float_types)
    ours = _float_tensors(float_dir)
    for name, values in ours.items():
        if gguf_weights.is_expert(name):
            assert values.dtype == np.float32
            assert torch.equal(torch.from_numpy(values), _transformers_expert(theirs, name))


def test_expert_gate_and_up_of_different_types_are_not_kept_raw(tmp_path):
    """Like q|k|v, an expert's gate|up are one stacked matrix in the executor: raw only when
    the file stores both in one type; down on its own. The layer then holds float gate|up
    linears next to GGUF-block down linears, and serves transformers' tokens."""
    from executor_svc.loading.loader import load_model

    hf_dir, _ = make_gguf("qwen2_moe", "F32", tmp_path / "src")

    def encode(name: str, values: np.ndarray):
        if values.ndim != 3:
            return None
        kind = gguf.GGMLQuantizationType.Q4_0 if "ffn_up" in name else \
            gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(values, kind), kind

    gguf_file = write_gguf(hf_dir, tmp_path / "mixed.gguf", "F32", encode=encode)
    model_dir = gguf_checkpoint_dir(gguf_file, tmp_path / "cache")
    types = json.loads((model_dir / "config.json").read_text())["quantization_config"][
        "tensor_types"]
    assert sorted({n.rsplit(".", 2)[-2] for n in types}) == ["down_proj"]
    assert {kind for kind in types.values()} == {"Q8_0"}

    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                       max_model_len=64)
    expert = model.model.layers[0].mlp.experts.expert(5)
    assert expert.gate_up_proj.weight.dtype == torch.float32
    assert getattr(expert.gate_up_proj, "gguf_type", None) is None
    assert expert.down_proj.gguf_type == "Q8_0"
    oracle = load_transformers_gguf(gguf_file, hf_dir)
    theirs = oracle.state_dict()
    for name, values in _loaded_experts(model_dir).items():
        torch.testing.assert_close(values, _transformers_expert(theirs, name), atol=1e-6,
                                   rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    prompts = _prompts(model_dir)
    assert folio_greedy(model_dir, prompts, NUM_NEW_TOKENS) == [
        hf_greedy(oracle, p, NUM_NEW_TOKENS) for p in prompts]


def test_q4_0_experts_take_their_block_bytes(moe_file, tmp_path, monkeypatch):
    """The "model loaded" line's expert_bytes count the experts' GGUF form (Q4_0: 4-bit
    nibbles with an fp16 scale and offset per 32 inputs, 0.625 bytes a weight), against 4
    bytes a weight for the same file converted with its experts dequantized."""
    from structlog.testing import capture_logs

    from executor_svc.loading.loader import load_model

    _, gguf_file, raw_dir = moe_file("qwen2_moe", *QUANTIZED["qwen2_moe"])
    monkeypatch.setattr(gguf_weights, "KEEP_EXPERTS_RAW", False)
    float_dir = gguf_checkpoint_dir(gguf_file, tmp_path / "float-cache")
    lines = {}
    for form, model_dir in (("raw", raw_dir), ("float", float_dir)):
        with capture_logs() as logs:
            load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                       max_model_len=64)
        lines[form] = next(e for e in logs if e["event"] == "model loaded")
    cfg = _facts(raw_dir)
    num = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert lines["float"]["expert_bytes"] == 4 * num
    assert 0.5 * num <= lines["raw"]["expert_bytes"] <= 0.8 * num, lines
    assert lines["raw"]["weight_bytes"] < lines["float"]["weight_bytes"]


def _tp_rank(rank: int, model_dir: str, refused_dir: str, out_dir: str) -> None:
    from executor_svc.loading.loader import load_model
    from tests.executor.parallel.test_tp_model import greedy_run

    result = greedy_run(Path(model_dir))
    try:
        load_model(Path(refused_dir), dtype=torch.float32, device=torch.device("cpu"),
                   max_model_len=64)
        refusal = None
    except CheckpointError as e:
        refusal = str(e)
    if rank == 0:
        torch.save({"run": result, "refusal": refusal}, Path(out_dir) / "tp2.pt")


def test_raw_experts_tp2_equal_tp1(moe_file, tmp_path):
    """Each rank reads its rows of every expert's gate|up blocks and its whole blocks of
    down's inputs (Mixtral: 128 / 2 = 64 inputs a rank, two Q4_0 blocks): TP = 2 gives the
    TP = 1 tokens and logits. A Qwen3-MoE file whose experts are 32 wide leaves each rank 16
    inputs of down, no whole block: refused, naming the flag and the layer."""
    from tests.executor.parallel.test_tp_model import greedy_run
    from tests.executor.parallel.tp_procs import run_ranks

    _, _, model_dir = moe_file("mixtral", *QUANTIZED["mixtral"])
    _, _, narrow_dir = moe_file("qwen3_moe", *QUANTIZED["qwen3_moe"])
    expected = greedy_run(model_dir)
    run_ranks(_tp_rank, 2, str(model_dir), str(narrow_dir), str(tmp_path))
    got = torch.load(tmp_path / "tp2.pt")
    assert got["run"]["tokens"] == expected["tokens"]
    for a, b in zip(got["run"]["logits"], expected["logits"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got["refusal"] is not None and "\n" not in got["refusal"]
    assert re.search(r"--tensor-parallel-size 2: model\.layers\.\d+\.mlp\.experts\.\d+\."
                     r"down_proj is stored as Q8_0 blocks of 32 inputs, and splitting its 32 "
                     r"inputs over 2 ranks leaves 16 per rank", got["refusal"]), got["refusal"]


def _copy_hf(hf_dir, dest, config_edit=None, drop=None):
    """A copy of `hf_dir` with its config.json edited and tensors dropped: the metadata and
    tensors write_gguf then writes."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(hf_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    if drop:
        weights = load_file(str(dest / "model.safetensors"))
        save_file({k: v for k, v in weights.items() if not drop(k)},
                  str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("case, arch, message", [
    ("expert_count", "qwen2_moe",
     r"tensor blk\.0\.ffn_down_exps\.weight holds 6 experts; metadata "
     r"qwen2moe\.expert_count says 4$"),
    ("no_down_exps", "qwen3_moe",
     r"lacks 1 tensor\(s\) a Qwen3MoeForCausalLM needs, e\.g\. blk\.1\.ffn_down_exps\.weight$"),
    ("no_expert_count", "qwen3_moe", r"metadata qwen3moe\.expert_count is missing"),
    ("top_k", "mixtral", r"metadata llama\.expert_used_count \(9\) is larger than "
                         r"llama\.expert_count \(8\)$"),
    ("sigmoid", "qwen2_moe", r"metadata qwen2moe\.expert_gating_func = 2: expert gating "
                             r"functions other than softmax \(1\) are not supported$"),
    ("weights_norm", "qwen2_moe", r"metadata qwen2moe\.expert_weights_norm = True"),
    ("expert_size", "mixtral",
     r"tensor blk\.0\.ffn_down_exps\.weight has shape \(8, 64, 128\); the metadata implies "
     r"\(8, 64, 96\)$"),
])
def test_malformed_moe_files_are_refused_by_name(case, arch, message, moe_file, tmp_path):
    from tests.fixtures import gguf_files

    hf_dir, _, _ = moe_file(arch)
    edit = drop = extra = None
    if case == "expert_count":
        def edit(c):
            c["num_experts"] = 4
    elif case == "no_down_exps":
        def drop(name):
            return name.startswith("model.layers.1.") and name.endswith("down_proj.weight") \
                and ".experts." in name
    elif case == "no_expert_count":
        def edit(c):
            c.pop("num_experts", None)
            c.pop("num_local_experts", None)
    elif case == "top_k":
        def edit(c):
            c["num_experts_per_tok"] = 9
    elif case == "expert_size":
        def edit(c):
            c["intermediate_size"] = 96
    elif case == "sigmoid":
        def extra(writer):
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    elif case == "weights_norm":
        def extra(writer):
            writer.add_expert_weights_norm(True)
    src = _copy_hf(hf_dir, tmp_path / "hf", edit, drop)
    bad = gguf_files.write_gguf(src, tmp_path / f"{case}.gguf", "F32", extra_metadata=extra)
    with pytest.raises(CheckpointError, match=message) as err:
        gguf_checkpoint_dir(bad, tmp_path / "cache")
    assert "\n" not in str(err.value)
