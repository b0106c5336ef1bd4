"""Quantized mixture-of-experts layers (executor_svc/quantization/experts.py).

- The method against `kernels.twins.fused_moe` on the dequantized weights, for every scheme:
  int8 and fp8 quantized at load (FusedMoE, and gpt-oss's biased clamped-SwiGLU experts), an
  fp8 checkpoint, GPTQ with act order and AWQ checkpoints; routings that leave experts
  untouched, send every token to one expert, or hold one token.
- The loader places a checkpoint's per-expert quantized tensors exactly (the dequantized
  weights equal the fixture's own reading of the files), names a missing one by its
  checkpoint name, and refuses a float tensor a GGUF config lists as blocks.
- Whole models greedy through the paged runner, token for token against HF transformers on
  the dequantized weights, prefill logits close; TP = 2 equals TP = 1 (int8 experts, a GPTQ
  act-order checkpoint).
- Memory: int8 experts take about a quarter of fp32's bytes in the "model loaded" line.
- The GPU path (Triton launchers) in Triton's interpreter.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints.files import CheckpointError
from executor_svc.loading.loader import load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.gpt_oss import GptOssExperts
from executor_svc.models.moe import Experts, FusedMoE
from executor_svc.quantization.experts import QuantizedExperts, dequantized_experts
from executor_svc.quantization.methods import METHODS
from kernels import twins
from tests.executor.harness import make_hf_model, save_checkpoint
from tests.fixtures.int4_checkpoints import (
    int4_reference_weights,
    write_awq_checkpoint,
    write_gptq_checkpoint,
    write_int4_dequantized_checkpoint,
)
from tests.fixtures.quant_checkpoints import (
    edit_config,
    write_dequantized_checkpoint,
    write_fp8_checkpoint,
)

CPU = torch.device("cpu")


def _load(model_dir: Path, quantization: str | None = None, **kwargs):
    return load_model(model_dir, dtype=torch.float32, device=CPU, max_model_len=256,
                      quantization=quantization, **kwargs)


def _routings(num_tokens: int, num_experts: int, top_k: int, seed: int):
    """(name, topk_weights, topk_ids): a random routing over half the experts (the others
    get no token), every token to one expert, and one token alone."""
    gen = torch.Generator().manual_seed(seed)
    half = torch.stack([torch.randperm(num_experts // 2, generator=gen)[:top_k]
                        for _ in range(num_tokens)]) * 2  # even experts only
    one = (torch.arange(top_k) + 3).expand(num_tokens, top_k)  # slot 0: expert 3 for all
    single = torch.randperm(num_experts, generator=gen)[:top_k][None]
    for name, ids in (("half_untouched", half), ("one_expert", one), ("one_token", single)):
        weights = torch.softmax(torch.randn(ids.shape, generator=gen), dim=-1)
        yield name, weights, ids


def _assert_equals_twin(layer: Experts, hidden: int, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> None:
    """fp32: equal up to float rounding. bf16: the twin is fp32 throughout, the layer rounds
    gate|up's output and the activation to bf16 (as a dense quantized MLP does)."""
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = dequantized_experts(layer)
    top_k = 2
    for name, weights, ids in _routings(11, layer.num_experts, top_k, seed):
        x = torch.randn(ids.shape[0], hidden, generator=gen).to(dtype)
        with torch.no_grad():
            got = layer(x, weights, ids)
        expected = twins.fused_moe(x, w13, w2, weights, ids, **layer.moe_options())
        assert got.dtype == dtype
        # bf16: a few roundings of 2^-9 each, against the output's scale.
        atol = 1e-5 if dtype == torch.float32 else 2**-5 * float(expected.abs().max())
        torch.testing.assert_close(got, expected, atol=atol, rtol=1e-5 if atol < 1e-4 else 0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _random_fused_moe(num_experts: int, hidden: int, intermediate: int,
                      dtype: torch.dtype = torch.float32) -> FusedMoE:
    torch.manual_seed(1)
    layer = FusedMoE(num_experts, hidden, intermediate, dtype)
    with torch.no_grad():
        layer.w13.normal_(0, 0.3)
        layer.w2.normal_(0, 0.3)
        layer.w2[1, 3].zero_()  # an all-zero row: scale 0, quantized to zeros
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantized_at_load_equals_the_twin(scheme, dtype):
    layer = _random_fused_moe(8, 40, 24, dtype)
    plain13, plain2 = layer.w13.detach().float(), layer.w2.detach().float()
    layer.method = QuantizedExperts(METHODS[scheme]())
    with torch.no_grad():
        layer.method.process_weights(layer)
    assert layer.has_expert_linears and "w13" not in dict(layer.named_parameters())
    w13, w2 = dequantized_experts(layer)
    # Each expert's rows quantized on their own: the int8 error is at most half a step.
    for plain, deq in ((plain13, w13), (plain2, w2)):
        step = plain.abs().amax(dim=-1, keepdim=True) / METHODS[scheme].qmax
        bound = step / 2 if scheme == "int8" else plain.abs() * 2**-4 + step * 2**-9
        assert ((deq - plain).abs() <= bound + 1e-7).all()
        assert not torch.equal(deq, plain)
    _assert_equals_twin(layer, 40, dtype=dtype)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_gpt_oss_experts_keep_their_biases_and_activation(scheme):
    cfg = ModelConfig.from_dict(dict(
        architectures=["GptOssForCausalLM"], vocab_size=64, hidden_size=32,
        intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
        swiglu_limit=1.5))
    torch.manual_seed(2)
    layer = GptOssExperts(cfg, torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
        layer.finish_loading()
    layer.method = QuantizedExperts(METHODS[scheme]())
    with torch.no_grad():
        layer.method.process_weights(layer)
    assert layer.moe_options()["activation"] == "swigluoai"
    _assert_equals_twin(layer, 32)


# --- checkpoints -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float")
    return {arch: save_checkpoint(make_hf_model(arch), root / arch)
            for arch in ("qwen3_moe", "mixtral")}


def _written(kind: str, src: Path, dst: Path) -> tuple[Path, Path]:
    """(the quantized checkpoint `kind`, the float checkpoint it equals)."""
    if kind == "fp8":
        served = write_fp8_checkpoint(src, dst / "fp8", per_channel=True)
        return served, write_dequantized_checkpoint(served, dst / "deq", "checkpoint")
    served = (write_gptq_checkpoint(src, dst / kind, 16, desc_act=True, sym=False)
              if kind == "gptq" else write_awq_checkpoint(src, dst / kind, 16))
    return served, write_int4_dequantized_checkpoint(served, dst / "deq")


CHECKPOINT_CASES = [("qwen3_moe", "fp8"), ("mixtral", "gptq"), ("qwen3_moe", "awq")]


@pytest.mark.parametrize("arch, kind", CHECKPOINT_CASES)
def test_checkpoint_experts_load_exactly_and_equal_the_twin(arch, kind, float_dirs, tmp_path):
    served, reference = _written(kind, float_dirs[arch], tmp_path)
    model = _load(served)
    want = load_file(reference / "model.safetensors")
    parts = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    moe_layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Experts)]
    assert moe_layers and all(m.has_expert_linears for _, m in moe_layers)
    for name, layer in moe_layers:
        w13, w2 = dequantized_experts(layer)
        for e in range(layer.num_experts):
            gate, up, down = (want[f"{name}.{e}.{p}.weight"] for p in parts)
            assert torch.equal(w13[e], torch.cat([gate, up])), (name, e)
            assert torch.equal(w2[e], down), (name, e)
        _assert_equals_twin(layer, model.cfg.hidden_size)
    if kind != "fp8":  # the fixture's independent reading of the packed files agrees
        files = int4_reference_weights(served)
        key = f"{moe_layers[0][0]}.5.{parts[2]}.weight"
        assert torch.equal(files[key].float(), want[key])


def _copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch, kind, missing", [
    ("mixtral", "gptq", "model.layers.1.block_sparse_moe.experts.6.w3.qzeros"),
    ("qwen3_moe", "fp8", "model.layers.2.mlp.experts.0.up_proj.weight_scale"),
])
def test_missing_quantized_expert_tensor_is_named(arch, kind, missing, float_dirs, tmp_path):
    served, _ = _written(kind, float_dirs[arch], tmp_path)
    broken = _copy(served, tmp_path / "broken", lambda t: t.pop(missing))
    with pytest.raises(CheckpointError, match=r"lacks tensors for 1 parameter\(s\) .*: "
                                              + missing.replace(".", r"\.") + "$"):
        _load(broken)


def test_quantized_expert_past_the_count_is_refused(float_dirs, tmp_path):
    served, _ = _written("awq", float_dirs["qwen3_moe"], tmp_path)
    edit_config(served, num_experts=7, num_local_experts=7)
    with pytest.raises(CheckpointError, match=r"checkpoint tensor model\.layers\.0\.mlp\.experts"
                                              r"\.7\.\w+\.\w+: expert 7 is past the 7 experts"):
        _load(served)


def test_gguf_expert_listed_but_stored_in_float_is_refused(float_dirs, tmp_path):
    """A GGUF tensor_types entry puts that expert's layer in the per-expert form with a raw
    block parameter for it (tests/checkpoints/gguf/test_convert_moe.py serves real ones); a
    float tensor there is refused by name, never cast into block bytes."""
    ckpt = tmp_path / "gguf"
    shutil.copytree(float_dirs["qwen3_moe"], ckpt)
    listed = "model.layers.0.mlp.experts.3.down_proj.weight"
    edit_config(ckpt, quantization_config={"quant_method": "gguf",
                                           "tensor_types": {listed: "Q8_0"}})
    with pytest.raises(CheckpointError, match=rf"tensor {listed.replace('.', r'[.]')} has "
                                              r"dtype F32, but quantization_config\."
                                              r"tensor_types lists it as GGUF blocks"):
        _load(ckpt)


# --- whole models --------------------------------------------------------------------------


MODEL_CASES = {  # name -> (arch, --quantization, written checkpoint kind)
    "qwen3_moe-int8": ("qwen3_moe", "int8", None),
    "mixtral-fp8": ("mixtral", "fp8", None),
    "qwen2_moe-fp8-ckpt": ("qwen2_moe", None, "fp8"),  # and its shared expert quantized
    "mixtral-gptq-act-order": ("mixtral", None, "gptq"),
    "gpt_oss-int8": ("gpt_oss", "int8", None),
}


@pytest.mark.parametrize("name", MODEL_CASES)
def test_greedy_equals_hf_on_the_dequantized_weights(name, tmp_path):
    from tests.e2e.hf_oracle import load_hf_model
    from tests.executor.harness import hf_greedy
    from tests.executor.parallel.test_tp_model import PROMPTS, greedy_run

    arch, flag, kind = MODEL_CASES[name]
    float_dir = save_checkpoint(make_hf_model(arch), tmp_path / "float")
    if kind is None:
        served = float_dir
        reference = write_dequantized_checkpoint(float_dir, tmp_path / "deq", flag)
    else:
        served, reference = _written(kind, float_dir, tmp_path)
    if arch == "gpt_oss":  # 3-D expert tensors: dequantize them as Folio quantizes them
        reference = _gpt_oss_dequantized(reference, flag)
    got = greedy_run(served, quantization=flag)
    hf_model = load_hf_model(reference)
    for i, prompt in enumerate(PROMPTS):
        tokens = got["tokens"][f"r{i}"]
        assert tokens == hf_greedy(hf_model, prompt, len(tokens)), (name, i)
    with torch.no_grad():  # the first step's logits: r0's and r1's prompts, whole
        expected = [hf_model(torch.tensor([p])).logits[0, -1] for p in PROMPTS[:2]]
    torch.testing.assert_close(got["logits"][0][:2], torch.stack(expected), atol=1e-4,
                               rtol=1e-4)


def _gpt_oss_dequantized(model_dir: Path, scheme: str) -> Path:
    """gpt-oss's experts.gate_up_proj [E, hidden, 2I] (gate/up interleaved) and down_proj
    [E, I, hidden] as the int8 model holds them: each output row (a column here) quantized."""
    tensors = load_file(model_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors[name].transpose(1, 2)  # [E, out, in]
        rows = [METHODS[scheme]().quantize(w[e]) for e in range(w.shape[0])]
        deq = torch.stack([q.float() * s[:, None] for q, s in rows])
        tensors[name] = deq.transpose(1, 2).contiguous()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


def _tp_rank(rank: int, model_dir: str, flag: str | None, out_dir: str) -> None:
    from tests.executor.parallel.test_tp_model import greedy_run

    result = greedy_run(Path(model_dir), quantization=flag)
    if rank == 0:
        torch.save(result, Path(out_dir) / "tp2.pt")


@pytest.mark.parametrize("kind", ["int8", "gptq"])
def test_experts_tp2_equal_tp1(kind, tmp_path):
    """int8 at load: each rank quantizes its slice of every expert, down's absmax max-reduced
    over the ranks. A GPTQ act-order checkpoint: each rank reads its columns of gate|up and its
    rows of down (and of g_idx) per expert. Either way TP = 2 holds the TP = 1 experts and
    gives its tokens and logits."""
    from tests.executor.parallel.test_tp_model import greedy_run
    from tests.executor.parallel.tp_procs import run_ranks

    model_dir = save_checkpoint(make_hf_model("qwen2_moe"), tmp_path / "ckpt")
    flag = "int8" if kind == "int8" else None
    if kind == "gptq":
        model_dir, _ = _written("gptq", model_dir, tmp_path)
    expected = greedy_run(model_dir, quantization=flag)
    run_ranks(_tp_rank, 2, str(model_dir), flag, str(tmp_path))
    got = torch.load(tmp_path / "tp2.pt")
    assert got["tokens"] == expected["tokens"]
    for a, b in zip(got["logits"], expected["logits"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if kind == "int8":  # the int8 model is not the float one
        plain = greedy_run(model_dir)
        assert any(not torch.allclose(a, b, atol=1e-5, rtol=1e-5)
                   for a, b in zip(plain["logits"], expected["logits"], strict=True))


def test_int8_experts_take_a_quarter_of_fp32_bytes(float_dirs):
    from structlog.testing import capture_logs

    lines = {}
    for flag in (None, "int8"):
        with capture_logs() as logs:
            _load(float_dirs["mixtral"], flag)
        lines[flag] = next(e for e in logs if e["event"] == "model loaded")
    cfg = ModelConfig.from_dir(float_dirs["mixtral"])
    num = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert lines[None]["expert_bytes"] == 4 * num
    # One byte a weight, plus an fp32 scale per row (and the skinny slabs' padding to 16).
    assert num <= lines["int8"]["expert_bytes"] <= 1.1 * num, lines
    assert lines["int8"]["weight_bytes"] < lines[None]["weight_bytes"]


TRITON_SCRIPT = r"""
import json
import torch
from executor_svc.quantization.methods import METHODS
from executor_svc.quantization.experts import QuantizedExperts, dequantized_experts
from kernels import twins
from tests.executor.quantization.test_quantized_experts import _random_fused_moe, _routings

errors = {}
for scheme in ("int8", "fp8"):
    layer = _random_fused_moe(6, 32, 16)
    layer.method = QuantizedExperts(METHODS[scheme]())
    with torch.no_grad():
        layer.method.process_weights(layer)
    assert all(layer.expert(e).down_proj.qweight.numel() for e in range(6))  # no CPU slabs
    w13, w2 = dequantized_experts(layer)
    for name, weights, ids in _routings(5, 6, 2, seed=3):
        x = torch.randn(ids.shape[0], 32)
        with torch.no_grad():
            got = layer(x, weights, ids)
        want = twins.fused_moe(x, w13, w2, weights, ids)
        errors[f"{scheme}-{name}"] = (got - want).abs().max().item()
print(json.dumps(errors))
"""


def test_quantized_experts_through_the_triton_launchers(tmp_path):
    """The GPU path (w8a16_linear's Triton kernel per expert), in Triton's interpreter: a fresh
    process, since `kernels` reads FOLIO_KERNELS at import."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "FOLIO_KERNELS": "triton", "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(errors) == 6 and max(errors.values()) < 1e-5, errors
