"""GGUF round trips for Phi-3, Gemma 2 and Gemma 3: HF checkpoint -> GGUF written as llama.cpp
writes it (tests/fixtures/gguf_files.py: fused Phi-3 tensors and LongRoPE factor tensors,
Gemma's norms plus one) -> Folio's converter -> the same HF checkpoint.

The converted directory must be the original: its config as HF reads it (up to the float32
GGUF stores numbers in), every tensor bit for bit (F32 files), and HF transformers generating
the same greedy tokens from both. Phi-3 is also served by Folio's executor from a Q8_0 file
whose fused projections stay raw blocks. (Gemma through Folio comes with its model classes.)
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from checkpoints.gguf import gguf_checkpoint_dir
from checkpoints.gguf.dequantize import dequantized_copy
from tests.checkpoints.gguf.test_convert import folio_greedy
from tests.executor.harness import hf_greedy
from tests.fixtures.gguf_files import write_gguf

ARCHS = ["phi3", "gemma2_gguf", "gemma3_gguf"]
# Config fields the converted directory need not share: bookkeeping, and training-only values
# a GGUF file never holds (HF's defaults come back for them).
IGNORED = {"transformers_version", "_name_or_path", "initializer_range"}


def _close(a, b) -> bool:
    """Equal, floats up to float32 rounding (GGUF metadata and factor tensors are float32)."""
    if isinstance(a, float) or isinstance(b, float):
        return (isinstance(a, int | float) and isinstance(b, int | float)
                and math.isclose(a, b, rel_tol=1e-6))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _hf_config(model_dir) -> dict:
    from transformers import AutoConfig

    d = AutoConfig.from_pretrained(model_dir).to_dict()
    return {k: v for k, v in d.items() if k not in IGNORED}


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_gives_the_original_checkpoint(arch, converted):
    from safetensors.numpy import load_file

    hf_dir, _, model_dir = converted(arch)
    ours, original = _hf_config(model_dir), _hf_config(hf_dir)
    differ = sorted(k for k in original.keys() | ours.keys()
                    if not _close(original.get(k), ours.get(k)))
    assert not differ, {k: (original.get(k), ours.get(k)) for k in differ}
    theirs, back = load_file(str(hf_dir / "model.safetensors")), load_file(
        str(model_dir / "model.safetensors"))
    if original["tie_word_embeddings"]:
        theirs.pop("lm_head.weight", None)
    assert sorted(back) == sorted(theirs)
    for name, values in theirs.items():
        assert back[name].dtype == np.float32 and np.array_equal(back[name], values), name


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_generates_the_same_from_the_converted_directory(arch, converted):
    from transformers import AutoModelForCausalLM

    hf_dir, _, model_dir = converted(arch)
    # 30 prompt tokens + 12: past the Gemma sliding window (32).
    prompts = [[5, 17, 42, 99, 7], [(11 * i + 3) % 2000 for i in range(30)]]
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
              for d in (hf_dir, model_dir)]
    original, back = ([hf_greedy(m, p, 12) for p in prompts] for m in models)
    assert back == original


@pytest.mark.parametrize("arch", ["gemma2_gguf", "gemma3_gguf"])
def test_gemma_files_served_by_folio_equal_hf_past_the_window(arch, converted):
    """The converted Gemma (norms back at w, Folio adding its 1 once) through Folio's model,
    prompts and generations past the 32-token window, against HF on the original."""
    from transformers import AutoModelForCausalLM

    hf_dir, _, model_dir = converted(arch)
    prompts = [[5, 17, 42, 99, 7], [(11 * i + 3) % 2000 for i in range(40)]]
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert folio_greedy(model_dir, prompts, 12) == [hf_greedy(hf_model, p, 12) for p in prompts]


def test_phi3_q8_0_file_served_by_folio_keeps_fused_raw_blocks(converted, tmp_path):
    """Q8_0: qkv_proj and gate_up_proj stay raw blocks, each part's rows read from the one
    tensor; the oracle is HF on the dequantized copy (what the blocks hold)."""
    from transformers import AutoModelForCausalLM

    _, _, model_dir = converted("phi3", "Q8_0")
    types = json.loads((model_dir / "config.json").read_text())["quantization_config"][
        "tensor_types"]
    assert types["model.layers.0.self_attn.qkv_proj.weight"] == "Q8_0"
    assert types["model.layers.1.mlp.gate_up_proj.weight"] == "Q8_0"
    reference = dequantized_copy(model_dir, tmp_path / "dequantized")
    hf_model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 99, 7, 250, 3], [42], [(7 * i + 1) % 2000 for i in range(23)]]
    expected = [hf_greedy(hf_model, p, 16) for p in prompts]
    assert folio_greedy(model_dir, prompts, 16) == expected


def test_phi3_without_longrope_and_phi4_mini_partial_rotary(tmp_path):
    from tests.fixtures.checkpoints import make_checkpoint

    # Phi-3-mini-4k: no rope_scaling, so no factor tensors: plain RoPE, the window kept.
    hf_dir = make_checkpoint("phi3", tmp_path / "plain", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0}, sliding_window=48,
        original_max_position_embeddings=512)
    out = gguf_checkpoint_dir(write_gguf(hf_dir, tmp_path / "plain.gguf", "F32"),
                              tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert config["sliding_window"] == 48
    assert config["original_max_position_embeddings"] == 512
    # Phi-4-mini rotates 3/4 of each head: rope.dimension_count 12 of head size 16, and its
    # LongRoPE factors cover those 12 dimensions (6 frequencies).
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.05 * i for i in range(6)],
            "long_factor": [1.0 + 0.6 * i for i in range(6)]}
    hf_dir = make_checkpoint("phi3", tmp_path / "partial", rope_parameters=rope)
    out = gguf_checkpoint_dir(write_gguf(hf_dir, tmp_path / "partial.gguf", "F32"),
                              tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.75
    assert len(config["rope_parameters"]["short_factor"]) == 6
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 99, 7], [(11 * i + 3) % 2000 for i in range(30)]]
    assert folio_greedy(out, prompts, 8) == [hf_greedy(hf_model, p, 8) for p in prompts]


@pytest.mark.parametrize("pattern, expected", [
    (None, ["sliding_attention"] * 5 + ["full_attention"]),  # Gemma 3's fixed period, 6
    (3, ["sliding_attention", "sliding_attention", "full_attention"] * 2),
    ([True, False, True, True, False, False],
     ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
      "full_attention", "full_attention"]),
])
def test_gemma3_layer_pattern_and_local_base_from_the_metadata(pattern, expected, converted,
                                                                tmp_path):
    hf_dir, _, _ = converted("gemma3_gguf")

    def extra(writer):
        if pattern is not None:
            writer.add_sliding_window_pattern(pattern)
        writer.add_rope_freq_base_swa(20000.0)

    out = gguf_checkpoint_dir(write_gguf(hf_dir, tmp_path / "g3.gguf", "F32",
                                         extra_metadata=extra), tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == expected
    assert config["rope_parameters"]["sliding_attention"] == {"rope_type": "default",
                                                              "rope_theta": 20000.0}
    assert config["rope_parameters"]["full_attention"] == {
        "rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}


def test_gemma2_27b_query_scale_and_stated_softcaps(tmp_path):
    """llama.cpp scales a 27B Gemma's queries by 1/sqrt(hidden / heads) (46 layers for Gemma
    2), every other size's by 1/sqrt(head_dim); soft-capping values come from the file."""
    from tests.fixtures.checkpoints import make_checkpoint

    hf_dir = make_checkpoint("gemma2_gguf", tmp_path / "hf", num_hidden_layers=46, hidden_size=32,
                             intermediate_size=32,
                             attn_logit_softcapping=40.0, final_logit_softcapping=20.0)
    out = gguf_checkpoint_dir(write_gguf(hf_dir, tmp_path / "g2.gguf", "F16"),
                              tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["query_pre_attn_scalar"] == 32 // 4  # hidden / heads, not head_dim (16)
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (40.0, 20.0)
    assert config["layer_types"][:3] == ["sliding_attention", "full_attention",
                                         "sliding_attention"]
