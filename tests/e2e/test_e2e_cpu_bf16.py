"""`folio serve --dtype bfloat16` on the CPU: bf16 weights and KV cache, end to end, against the
fp32 path on the real default model (SmolLM2-135M-Instruct).

The fp32 reference is transformers' greedy decoding of the same GGUF in fp32, which Folio's fp32
path matches token for token (test_e2e_real_model.py). bf16 rounding may change a near-tie
argmax, after which the two continuations are different texts, so agreement is counted up to
each prompt's first divergence:

    agreement = sum over prompts of (length of the common prefix of bf16 and fp32 tokens)
                / sum over prompts of (fp32 tokens)

8 prompts x up to 64 tokens; asserted >= 0.95 and printed (pytest -s shows it).
"""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncFolioClient

MAX_TOKENS = 64
MIN_AGREEMENT = 0.95
PROMPTS = [
    dict(prompt="The capital of France is"),
    dict(prompt="def fibonacci(n):"),
    dict(prompt="Once upon a time, in a small village,"),
    dict(prompt="The three primary colors are"),
    dict(messages=[{"role": "user", "content": "What is the capital of France?"}]),
    dict(messages=[{"role": "user", "content": "Name two planets of the solar system."}]),
    dict(messages=[{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "Say hello in French."}]),
    dict(messages=[{"role": "user", "content": "What is 2 + 2?"}]),
]

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def hf_fp32():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from executor_svc.named_models import smollm2_gguf

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    return model, tokenizer


def hf_greedy(model, tokenizer, prompt_ids: list[int]) -> list[int]:
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def test_bf16_greedy_agrees_with_fp32(folio_server, hf_fp32):
    model, tokenizer = hf_fp32
    with folio_server(model=None, args=["--dtype", "bfloat16"]) as server:
        async with AsyncFolioClient(server.address, timeout=300) as client:
            info = await client.model_info()
            prompt_ids = [await client.tokenize(p.get("prompt"), messages=p.get("messages"))
                          for p in PROMPTS]
            done = await asyncio.gather(*(
                client.generate_text(**p, max_tokens=MAX_TOKENS, temperature=0.0)
                for p in PROMPTS))
    assert info["dtype"] == "bfloat16" and info["device"] == "cpu"
    matched = total = 0
    for ids, completion in zip(prompt_ids, done, strict=True):
        want = hf_greedy(model, tokenizer, ids)
        matched += common_prefix(completion.token_ids, want)
        total += len(want)
    agreement = matched / total
    print(f"\nbf16 vs fp32 greedy agreement (common prefix per prompt): {matched}/{total} = "
          f"{agreement:.3f}")
    assert agreement >= MIN_AGREEMENT
