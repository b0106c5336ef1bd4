"""Quantized linear methods and the loader's part: the methods against a float64 reference,
weight memory per scheme, fp8 checkpoints (per tensor, per channel, static input scales)
loaded as they are, every refusal naming what is wrong, and the scheme's config fuzzed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from checkpoints.files import CheckpointError
from checkpoints.quant_config import checkpoint_quant_config, resolve_quant_config
from executor_svc.config import ExecutorConfig
from executor_svc.loading.loader import load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.linear import Linear
from executor_svc.quantization.methods import METHODS, quantized_weight, quantized_weight_bytes
from scheduler_svc.config import SchedulerConfig, build_parser
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.quant_checkpoints import edit_config, projection_weights, write_fp8_checkpoint

CPU = torch.device("cpu")


def _load(model_dir, quantization=None):
    return load_model(model_dir, dtype=torch.float32, device=CPU, max_model_len=64,
                      quantization=quantization)


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    return make_checkpoint("qwen2", tmp_path_factory.mktemp("q") / "float")  # biases, tied


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("shape", [(1, 64, 48), (9, 33, 70), (40, 130, 17)])
def test_method_against_float64_of_the_dequantized_weight(scheme, shape):
    num_tokens, out_features, in_features = shape
    torch.manual_seed(0)
    layer = Linear(in_features, out_features, bias=True)
    plain = layer.weight.detach().clone()
    method = METHODS[scheme]()
    layer.method = method
    with torch.no_grad():
        method.process_weights(layer)
    assert layer.weight.numel() == 0  # released
    dequant = quantized_weight(layer).double() * layer.qscale.double()[:, None]
    # The quantization error itself is bounded by half a step (int8) / 2^-4 relative (e4m3).
    step = layer.qscale.double()[:, None]
    bound = step / 2 if scheme == "int8" else plain.abs().double() * 2**-4 + step * 2**-9
    assert ((dequant - plain.double()).abs() <= bound + 1e-12).all()
    x = torch.randn(num_tokens, in_features)
    expected = x.double() @ dequant.t() + layer.bias.double()
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_weight_bytes_per_scheme(float_ckpt):
    """Quantized layers hold N*K one-byte weights plus N fp32 scales, against 4*N*K bytes."""
    plain = load_file(float_ckpt / "model.safetensors")
    names = projection_weights(plain)
    plain_bytes = sum(plain[n].numel() * 4 for n in names)
    rows = sum(plain[n].shape[0] for n in names)
    for scheme in ("int8", "fp8"):
        model = _load(float_ckpt, scheme)
        layers = [m for m in model.modules() if hasattr(m, "qweight")]
        assert len(layers) == 4 * ModelConfig.from_dir(float_ckpt).num_layers  # not lm_head
        got = sum(quantized_weight_bytes(m) for m in layers)
        assert got == plain_bytes // 4 + 4 * rows, scheme
        assert all(m.weight.numel() == 0 for m in layers)  # no plain copy kept
        assert {quantized_weight(m).dtype for m in layers} == {METHODS[scheme].weight_dtype}


@pytest.mark.parametrize("per_channel, static", [(True, False), (False, True)])
def test_fp8_checkpoint_loads_as_it_is(float_ckpt, tmp_path, per_channel, static):
    ckpt = write_fp8_checkpoint(float_ckpt, tmp_path / "fp8", per_channel, static)
    tensors = load_file(ckpt / "model.safetensors")
    model = _load(ckpt)
    attn = model.model.layers[1].self_attn
    p = "model.layers.1.self_attn."
    q = torch.cat([tensors[p + f"{s}_proj.weight"] for s in "qkv"])
    qweight = quantized_weight(attn.qkv_proj)  # CPU backend: unpacked from its fp8 slabs
    assert qweight.dtype == torch.float8_e4m3fn
    assert torch.equal(qweight.view(torch.uint8), q.view(torch.uint8))
    # One scale per row: each shard's own scalar, or the checkpoint's channel scales.
    scales = torch.cat([tensors[p + f"{s}_proj.weight_scale"].reshape(-1).expand(
        tensors[p + f"{s}_proj.weight"].shape[0]) for s in "qkv"])
    assert torch.equal(attn.qkv_proj.qscale, scales.float())
    assert model.lm_head.method.__class__.__name__ != "Fp8WeightOnly"
    down = _load(ckpt, "fp8").model.layers[0].mlp.down_proj
    assert quantized_weight(down).dtype == torch.float8_e4m3fn


def _rewrite(model_dir, edit):
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def test_fp8_checkpoint_strictness(float_ckpt, tmp_path):
    base = write_fp8_checkpoint(float_ckpt, tmp_path / "base", per_channel=True)
    p = "model.layers.0.self_attn."
    cases = {
        "missing_shard_scale": (lambda t: t.pop(p + "k_proj.weight_scale"),
                                r"lacks tensors.*qkv_proj\.weight_scale \(shard 1\)"),
        "float_weight_in_fp8_layer": (
            lambda t: t.update({p + "o_proj.weight": t[p + "o_proj.weight"].float()}),
            r"o_proj\.weight has dtype F32, but its layer has a weight_scale"),
        "fp8_weight_without_scale": (lambda t: t.pop(p + "o_proj.weight_scale"),
                                     r"o_proj\.weight is F8_E4M3 but has no weight_scale"),
        "orphan_input_scale": (
            lambda t: t.update({"model.norm.input_scale": torch.tensor(1.0)}),
            r"no matching parameter.*model\.norm\.input_scale"),
        "mixed_layouts": (lambda t: t.update({p + "k_proj.weight_scale": torch.tensor(0.1)}),
                          r"scales of one layer stored in different or unknown layouts"),
        "channel_scale_wrong_size": (
            lambda t: t.update({p + "o_proj.weight_scale": torch.ones(7, 1)}),
            r"o_proj\.weight_scale has shape \(7, 1\)"),
    }
    for name, (edit, message) in cases.items():
        ckpt = tmp_path / name
        shutil.copytree(base, ckpt)
        _rewrite(ckpt, edit)
        with pytest.raises(CheckpointError, match=message):
            _load(ckpt)
    # fp8 tensors in a checkpoint that declares no quantization.
    ckpt = tmp_path / "no_config"
    shutil.copytree(base, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"is F8_E4M3 but has no weight_scale \(or "
                                              r"config\.json declares no fp8"):
        _load(ckpt)


def test_refusals_name_the_scheme(float_ckpt, tmp_path):
    ckpt = tmp_path / "gptq"
    shutil.copytree(float_ckpt, ckpt)
    edit_config(ckpt, quantization_config={"quant_method": "bitsandbytes", "bits": 4})
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported quantization scheme "
                                              r"'bitsandbytes' \(supported: int8, fp8, gptq, "
                                              r"awq, gguf"):
        _load(ckpt)
    edit_config(ckpt, quantization_config={"quant_method": "fp8",
                                           "weight_block_size": [128, 128]})
    with pytest.raises(CheckpointError, match=r"block-wise fp8.*not supported"):
        _load(ckpt)
    fp8 = write_fp8_checkpoint(float_ckpt, tmp_path / "fp8", per_channel=False)
    with pytest.raises(ValueError, match=r"--quantization int8 disagrees with the checkpoint, "
                                         r"whose config\.json declares fp8"):
        resolve_quant_config("int8", fp8)
    with pytest.raises(ValueError, match=r"unsupported quantization scheme 'int4'"):
        resolve_quant_config("int4", float_ckpt)
    with pytest.raises(ValueError, match=r"--quantization must be one of int8, fp8"):
        ExecutorConfig(model="x", quantization="int4")
    with pytest.raises(ValueError, match=r"--quantization must be one of int8, fp8, gptq"):
        SchedulerConfig(quantization="int4")
    args = build_parser().parse_args(["--quantization", "fp8"])
    assert SchedulerConfig(**vars(args)).executor_flags()[:2] == ["--quantization", "fp8"]


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(qc=st.one_of(_json, st.fixed_dictionaries(
    {"quant_method": st.sampled_from(["fp8", "gptq", "awq", "FP8", None])},
    optional={"activation_scheme": _json, "weight_block_size": _json,
              "ignored_layers": _json, "bits": _json | st.sampled_from([4, 8]),
              "group_size": _json | st.sampled_from([-1, 32, 128]), "desc_act": _json,
              "checkpoint_format": _json | st.just("gptq_v2"), "version": _json,
              "zero_point": _json})))
def test_quantization_config_fuzz(qc):
    """Any quantization_config is a scheme Folio loads or a ValueError saying which field."""
    try:
        got = checkpoint_quant_config({"quantization_config": qc})
    except ValueError as e:
        assert any(w in str(e) for w in ("quantization", "activation_scheme", "weight_block_size",
                                         "bits", "group_size", "desc_act", "checkpoint_format",
                                         "version", "zero point")), e
    else:
        assert qc is None or (got is not None and got.from_checkpoint
                              and got.scheme == qc["quant_method"])


def _int8_rank(rank: int, model_dir: str, out_dir: str) -> None:
    from tests.executor.parallel.test_tp_model import greedy_run

    result = greedy_run(Path(model_dir), quantization="int8")
    if rank == 0:
        torch.save(result, Path(out_dir) / "tp2.pt")


def test_int8_tp2_equals_tp1(tmp_path):
    """Each rank quantizes its shard; a row-parallel layer's scales take the absmax over the
    ranks, so TP = 2 holds the TP = 1 int8 model and gives its tokens and logits."""
    from tests.executor.harness import make_hf_model, save_checkpoint
    from tests.executor.parallel.test_tp_model import greedy_run
    from tests.executor.parallel.tp_procs import run_ranks

    model_dir = save_checkpoint(make_hf_model("qwen2"), tmp_path / "ckpt")
    expected = greedy_run(model_dir, quantization="int8")
    run_ranks(_int8_rank, 2, str(model_dir), str(tmp_path))
    got = torch.load(tmp_path / "tp2.pt")
    assert got["tokens"] == expected["tokens"]
    for a, b in zip(got["logits"], expected["logits"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The int8 model is not the float one (the comparison above has teeth).
    plain = greedy_run(model_dir)
    assert any(not torch.allclose(a, b, atol=1e-5, rtol=1e-5)
               for a, b in zip(plain["logits"], expected["logits"], strict=True))


def test_scheduler_knows_every_scheme():
    """`folio serve` checks --quantization before it starts the executor, against the list
    the executor loads (checkpoints.quant_config)."""
    from checkpoints.quant_config import SCHEMES
    from scheduler_svc.config import SchedulerConfig

    for scheme in SCHEMES:
        assert SchedulerConfig(quantization=scheme).quantization == scheme
    with pytest.raises(ValueError, match="--quantization must be one of int8, fp8"):
        SchedulerConfig(quantization="nf4")
