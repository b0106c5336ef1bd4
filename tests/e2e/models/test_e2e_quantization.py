"""Quantized models through the real server (CPU): `folio serve --quantization int8|fp8`, and
fp8, GPTQ (act order) and AWQ checkpoints loaded as they are; dense and mixture-of-experts
families (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert), every expert quantized.

A quantized model is a deterministic function of its quantized weights, so its oracle is HF
transformers serving the dequantized weights (tests/fixtures/quant_checkpoints.py) in fp32: greedy
tokens must be equal, token for token. Against the unquantized model only agreement can be
asked: the mean share of each continuation that matches the float model's before the first
difference is asserted above a floor set under the measured value (AGREEMENT_FLOOR).
"""

from __future__ import annotations

import pytest

from tests.e2e.hf_oracle import hf_greedy, load_hf_model, random_prompts
from tests.e2e.models.test_e2e_greedy import MAX_TOKENS, assert_same_tokens, generate_all
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.int4_checkpoints import (
    write_awq_checkpoint,
    write_gptq_checkpoint,
    write_int4_dequantized_checkpoint,
)
from tests.fixtures.quant_checkpoints import write_dequantized_checkpoint, write_fp8_checkpoint

PROMPT_LENGTHS = (1, 7, 16, 17, 64, 131)
# name -> (arch, --quantization, checkpoint written from the float one: None, ("fp8",
# per_channel, static input scales), ("gptq", act order) or ("awq",)).
# llama2: untied head; qwen2: q/k/v biases, tied embeddings, one scale per fused shard.
CASES = {
    "llama2-int8": ("llama2", "int8", None),
    "llama2-fp8": ("llama2", "fp8", None),
    "qwen2-int8": ("qwen2", "int8", None),
    "qwen2-fp8-ckpt-tensor": ("qwen2", None, ("fp8", False, True)),
    "llama3-fp8-ckpt-channel": ("llama3", None, ("fp8", True, False)),
    "llama2-gptq-act-order": ("llama2", None, ("gptq", True)),
    "qwen2-gptq": ("qwen2", "gptq", ("gptq", False)),
    "qwen2-awq": ("qwen2", None, ("awq",)),
    # Gemma: GeGLU, four (1 + w) norms per layer, sliding windows and softcaps.
    "gemma2-int8": ("gemma2", "int8", None),
    "gemma3-fp8-ckpt-channel": ("gemma3", None, ("fp8", True, False)),
    # Mixture of experts: every expert quantized (executor_svc/quantization/experts.py).
    "qwen3_moe-int8": ("qwen3_moe", "int8", None),
    "qwen3_moe-fp8": ("qwen3_moe", "fp8", None),
    "mixtral-int8": ("mixtral", "int8", None),
    "mixtral-fp8": ("mixtral", "fp8", None),
    "qwen2_moe-fp8-ckpt-tensor": ("qwen2_moe", None, ("fp8", False, False)),
    "mixtral-gptq-act-order": ("mixtral", None, ("gptq", True)),
    "qwen3_moe-awq": ("qwen3_moe", None, ("awq",)),
}
# Server runs kept in the default tier; the others are slow (CI time): the executor-level
# tests (tests/executor/quantization/) cover their layers and whole models.
FAST = {"llama2-int8", "llama2-fp8", "qwen2-int8", "qwen2-fp8-ckpt-tensor",
        "llama3-fp8-ckpt-channel", "llama2-gptq-act-order", "qwen2-gptq", "qwen2-awq",
        "qwen3_moe-int8"}
# Measured on these checkpoints and prompts (mean common-prefix share of 32 tokens):
# llama2-int8 0.646, llama2-fp8 0.047, qwen2-int8 1.000, qwen2 fp8 checkpoint 0.359, llama3
# fp8 checkpoint 0.557, 4-bit RTN group 16: llama2 GPTQ act order 0.036, qwen2 GPTQ 0.188,
# qwen2 AWQ 0.151, gemma2 int8 0.870, gemma3 fp8 checkpoint (per channel) 0.203; MoE:
# qwen3_moe int8 0.750, fp8 0.177, mixtral int8 0.266, fp8 0.057, qwen2_moe fp8 checkpoint
# (per tensor) 0.495, mixtral GPTQ act order 0.021, qwen3_moe AWQ 0.047. Random
# tiny models have nearly tied logits, so fp8's 3-bit mantissa flips an early argmax often; the floors sit below the measurements (other CPUs round
# differently) and catch a model that has lost its weights (agreement ~0).
AGREEMENT_FLOOR = {"llama2-int8": 0.5, "llama2-fp8": 0.02, "qwen2-int8": 0.8,
                   "qwen2-fp8-ckpt-tensor": 0.25, "llama3-fp8-ckpt-channel": 0.4,
                   "llama2-gptq-act-order": 0.02, "qwen2-gptq": 0.1, "qwen2-awq": 0.08,
                   "gemma2-int8": 0.6, "gemma3-fp8-ckpt-channel": 0.1,
                   "qwen3_moe-int8": 0.5, "qwen3_moe-fp8": 0.08, "mixtral-int8": 0.12,
                   "mixtral-fp8": 0.02, "qwen2_moe-fp8-ckpt-tensor": 0.25,
                   "mixtral-gptq-act-order": 0.01, "qwen3_moe-awq": 0.02}


@pytest.fixture(scope="module", params=[
    name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in CASES])
def case(request, tmp_path_factory):
    arch, flag, written = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    float_dir = make_checkpoint(arch, root / "float")
    kind = written[0] if written else None
    if kind in ("gptq", "awq"):  # RTN values in the tools' layout, group 16
        served = (write_gptq_checkpoint(float_dir, root / kind, 16, desc_act=written[1],
                                        sym=False) if kind == "gptq"
                  else write_awq_checkpoint(float_dir, root / kind, 16))
        reference = write_int4_dequantized_checkpoint(served, root / "dequantized")
        return request.param, flag, float_dir, served, reference
    served = float_dir if kind is None else write_fp8_checkpoint(float_dir, root / "fp8",
                                                                 *written[1:])
    reference = write_dequantized_checkpoint(served, root / "dequantized",
                                             flag or "checkpoint")
    return request.param, flag, float_dir, served, reference


async def test_quantized_greedy(case, folio_server):
    name, flag, float_dir, served, reference = case
    ref_model = load_hf_model(reference)
    prompts = random_prompts(ref_model.config.vocab_size, PROMPT_LENGTHS, seed=4)
    args = ["--block-size", "16"] + (["--quantization", flag] if flag else [])
    with folio_server(model=served, args=args) as server:
        got = await generate_all(server.address, prompts)
    expected = hf_greedy(ref_model, prompts, MAX_TOKENS)
    assert_same_tokens(ref_model, prompts, expected, got)
    plain = hf_greedy(load_hf_model(float_dir), prompts, MAX_TOKENS)
    agreement = sum(_common_prefix(p, g) for p, g in zip(plain, got, strict=True)) / (
        MAX_TOKENS * len(prompts))
    print(f"{name}: greedy agreement with the float model {agreement:.3f}")
    assert agreement >= AGREEMENT_FLOOR[name], (name, agreement)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
