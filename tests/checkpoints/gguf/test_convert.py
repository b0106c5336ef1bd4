"""GGUF round trips: HF checkpoint -> GGUF (tests/fixtures/gguf_files.py) -> Folio's converter -> Folio's
executor model, against HF transformers loading the same GGUF (`gguf_file=`, fp32).

Where transformers' GGUF reader misreads a file, the oracle gets the original HF config
instead (`config=`), and our converted config is checked against that original:
- llama3 RoPE scaling: llama.cpp stores it as the `rope_freqs` tensor, which transformers
  drops (it builds unscaled RoPE);
- qwen3 head_dim: transformers ignores `qwen3.attention.key_length` and takes the class
  default (128).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from checkpoints.files import CheckpointError
from checkpoints.gguf import gguf_checkpoint_dir
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.rope import inv_freq_for
from scheduler_svc.text.tokenizer import ChatTurn, Tokenizer
from tests.executor.harness import PlanDriver, hf_greedy, make_runner
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.gguf_files import make_gguf, write_gguf

CASES = [("llama2", "F16"), ("llama2", "Q8_0"), ("llama3", "Q8_0"), ("mistral", "F16"),
         ("qwen2", "F16"), ("qwen2", "Q8_0"), ("qwen3", "F16"), ("qwen3", "Q8_0")]
MISREAD_BY_TRANSFORMERS = {"llama3": "rope", "qwen3": "head_dim"}
NUM_NEW_TOKENS = 24
TEXTS = ["The harbor was quiet before dawn.", "def add(a, b):\n    return a + b",
         "Ελληνικά, 日本語 and emoji 🚀 too"]


def load_transformers_gguf(gguf_file, hf_dir=None):
    """transformers' own GGUF loading, fp32; `hf_dir`'s config replaces the file's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"config": AutoConfig.from_pretrained(hf_dir)} if hf_dir is not None else {}
    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                dtype=torch.float32, **extra).eval()


def folio_greedy(model_dir, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """Greedy tokens from Folio's executor model: all prompts in one batch, then decodes."""
    runner = make_runner(model_dir, num_blocks=400)  # KV groups take a block each a position
    driver = PlanDriver(400, seed=3, num_kv_groups=runner.kv_cache.layout.num_groups)
    generated = {f"r{i}": [] for i in range(len(prompts))}
    plan = driver.plan(new_reqs=[driver.new(r, p, len(p))
                                 for r, p in zip(generated, prompts, strict=True)])
    while True:
        out = runner.execute(plan)
        driver.record(out.sampled)
        for req_id, ids in out.sampled:
            generated[req_id].extend(ids)
        if all(len(g) >= num_new for g in generated.values()):
            return [g[:num_new] for g in generated.values()]
        plan = driver.plan(cached_reqs=driver.decode_all(list(generated)))


def model_facts(config: dict, architectures: list[str]) -> ModelConfig:
    """What Folio reads from a config (transformers' GGUF config names no class: its
    model_type, compared separately, stands for it)."""
    return ModelConfig.from_dict({**config, "architectures": architectures})


@pytest.mark.parametrize("arch, tensor_type", CASES)
def test_greedy_tokens_match_transformers_on_the_same_gguf(arch, tensor_type, converted):
    hf_dir, gguf_file, model_dir = converted(arch, tensor_type)
    tok = Tokenizer(model_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    prompts.append(tok.encode_chat([ChatTurn("user", "What is the capital of France?")]))
    hf_model = load_transformers_gguf(
        gguf_file, hf_dir if arch in MISREAD_BY_TRANSFORMERS else None)
    expected = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts]
    assert folio_greedy(model_dir, prompts, NUM_NEW_TOKENS) == expected


@pytest.mark.parametrize("arch, tensor_type", [c for c in CASES if c[1] == "F16"]
                         + [("llama3", "Q8_0")])
def test_config_matches_transformers(arch, tensor_type, converted):
    from transformers import AutoConfig

    hf_dir, gguf_file, model_dir = converted(arch, tensor_type)
    ours = json.loads((model_dir / "config.json").read_text())
    theirs = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).to_dict()
    original = json.loads((hf_dir / "config.json").read_text())
    for key in ("model_type", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours[key] == theirs[key], key
    archs = ours["architectures"]
    ours_facts, their_facts = model_facts(ours, archs), model_facts(theirs, archs)
    misread = MISREAD_BY_TRANSFORMERS.get(arch)
    if misread == "head_dim":
        assert ours_facts.head_dim == original["head_dim"]
        their_facts = dataclasses.replace(their_facts, head_dim=ours_facts.head_dim,
                                          rotary_dim=ours_facts.rotary_dim)
    if misread == "rope":  # the same inverse frequencies as HF's llama3 scaling
        torch.testing.assert_close(inv_freq_for(ours_facts.rope, ours_facts.head_dim),
                                   inv_freq_for(model_facts(original, archs).rope,
                                                ours_facts.head_dim), rtol=1e-6, atol=0)
        their_facts = dataclasses.replace(their_facts, rope=ours_facts.rope)
    # The converted checkpoint states the dtype its float tensors were written in, which a
    # GGUF file (and so transformers' config read from one) does not.
    assert ours_facts.checkpoint_dtype == "float32" and their_facts.checkpoint_dtype is None
    their_facts = dataclasses.replace(their_facts, checkpoint_dtype="float32")
    assert ours_facts == their_facts


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 16.0, "beta_slow": 2.0}


def test_yarn_scaling_survives_the_round_trip(tmp_path):
    """A YaRN checkpoint written to GGUF as llama.cpp writes it (scaling type, factor, original
    context, beta_fast/beta_slow) converts back to the same RoPE and context, and generates past
    the original context exactly as HF does on the original checkpoint."""
    hf_dir, gguf_file = make_gguf("qwen2", "F16", tmp_path, rope_parameters=YARN,
                                  max_position_embeddings=16)
    model_dir = gguf_checkpoint_dir(gguf_file, tmp_path / "cache")
    archs = ["Qwen2ForCausalLM"]
    ours = model_facts(json.loads((model_dir / "config.json").read_text()), archs)
    original = model_facts(json.loads((hf_dir / "config.json").read_text()), archs)
    assert ours.rope == original.rope and ours.rope.rope_type == "yarn"
    assert ours.rope.max_position(ours.max_position_embeddings) == 64
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok = Tokenizer(model_dir)
    prompts = [tok.encode(t) for t in TEXTS[:2]]  # 9+ tokens: 24 more cross position 16
    expected = [hf_greedy(hf_model, p, NUM_NEW_TOKENS) for p in prompts]
    assert folio_greedy(model_dir, prompts, NUM_NEW_TOKENS) == expected


def test_yarn_settings_with_another_meaning_are_refused(tmp_path):
    """llama.cpp's YaRN attention factors multiply the computed scale (HF's replaces it): a file
    stating one is refused with the key's name, never served with a guessed meaning."""
    from tests.fixtures import gguf_files

    hf_dir = make_checkpoint("qwen2", tmp_path / "hf", rope_parameters=YARN,
                             max_position_embeddings=16)

    def tokenizer_and_log_multiplier(writer) -> None:
        gguf_files._write_tokenizer(writer, hf_dir)
        writer.add_float32("qwen2.rope.scaling.yarn_log_multiplier", 0.1)

    bad = write_gguf(hf_dir, tmp_path / "bad.gguf", "F16",
                     write_tokenizer=tokenizer_and_log_multiplier)
    with pytest.raises(CheckpointError, match=r"qwen2\.rope\.scaling\.yarn_log_multiplier: this "
                                              "YaRN setting is not supported"):
        gguf_checkpoint_dir(bad, tmp_path / "cache")


def test_generation_config_lists_the_end_of_turn_id(converted):
    _, _, model_dir = converted("llama2", "F16")
    gen = json.loads((model_dir / "generation_config.json").read_text())
    tok = Tokenizer(model_dir)
    end_ids = {tok.encode(t, add_special_tokens=False)[0]
               for t in ("<|end_of_text|>", "<|im_end|>")}
    assert set(gen["eos_token_id"]) == end_ids
    assert tok.eos_token_ids == end_ids


# Tensor types a file can hold, with the bytes of each block's f16 scale(s) for the types the
# gguf package cannot quantize (their blocks are random bytes with sane scales).
_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                  "Q6_K": (208,), "IQ4_NL": (0,)}
ALL_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
             "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"]


def _encode_round_robin(used: dict[str, str]):
    import gguf

    rng = np.random.default_rng(7)

    def encode(name: str, values: np.ndarray):
        if values.ndim != 2:
            return None
        kind_name = ALL_TYPES[len(used) % len(ALL_TYPES)]
        used[name] = kind_name
        kind = gguf.GGMLQuantizationType[kind_name]
        if kind_name not in _SCALE_OFFSETS:
            return gguf.quants.quantize(values, kind), kind
        block, size = gguf.GGML_QUANT_SIZES[kind]
        rows, num_blocks = values.shape[0], values.shape[1] // block
        data = rng.integers(0, 256, (rows, num_blocks, size), dtype=np.uint8)
        for offset in _SCALE_OFFSETS[kind_name]:
            scales = rng.uniform(1e-3, 1e-2, (rows, num_blocks)).astype(np.float16)
            data[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, num_blocks, 2)
        return data.reshape(rows, num_blocks * size), kind

    return encode


def test_every_tensor_type_dequantizes_like_transformers(tmp_path):
    """One file holding every supported type (K-quants need rows of 256): each converted
    tensor equals the parameter transformers loads from the same file (raw blocks once
    dequantized by the gguf package)."""
    import gguf
    from safetensors.numpy import load_file

    hf_dir = make_checkpoint("llama2", tmp_path / "hf", hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)
    used: dict[str, str] = {}
    gguf_file = write_gguf(hf_dir, tmp_path / "all-types.gguf", encode=_encode_round_robin(used))
    assert sorted(set(used.values())) == sorted(ALL_TYPES)
    model_dir = gguf_checkpoint_dir(gguf_file, tmp_path / "cache")
    ours = load_file(str(model_dir / "model.safetensors"))
    # The round robin gives fused projections (q|k|v, gate|up) mixed types: only those
    # whose group shares one kept type would stay raw (tests/executor/quantization/test_gguf_quantized.py).
    raw = json.loads((model_dir / "config.json").read_text()).get(
        "quantization_config", {"tensor_types": {}})["tensor_types"]
    theirs = load_transformers_gguf(gguf_file).state_dict()
    assert set(ours) == set(theirs)
    assert set(raw.values()) <= {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}
    for name, values in ours.items():
        kind = used.get(_gguf_name(name))
        if name in raw:  # kept as raw blocks (in HF row order): dequantized by the package
            assert raw[name] == kind and values.dtype == np.uint8, name
            values = gguf.quants.dequantize(values, gguf.GGMLQuantizationType[kind])
        else:
            assert values.dtype == (np.float16 if kind == "F16" else np.float32), name
        assert torch.equal(torch.from_numpy(values.astype(np.float32)), theirs[name]), name


def _gguf_name(hf_name: str) -> str:
    from tests.fixtures.gguf_files import gguf_tensor_name

    return gguf_tensor_name(hf_name)
