"""Sliding-window families against HF transformers with prompts far longer than their windows
(8..16 tokens): Mistral (every layer), Qwen2 (layers from max_window_layers on), Gemma 2
(alternating, softcapped), Gemma 3 (two sliding layers per full one, a local RoPE base and a
scaled global RoPE) and gpt-oss (alternating, attention sinks, YaRN over an original context
of 64 that the prompts cross). fp32 on the CPU, through the paged KV cache and real step plans."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.executor.harness import PlanDriver, hf_greedy, make_runner

WINDOWED = ["mistral", "qwen2_window", "gemma2", "gemma3", "gpt_oss"]
NUM_BLOCKS = 240  # block size 4: room for every prompt below and its continuation
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(300) for _ in range(n)] for n in (131, 100, 37, 1)]


def _prefill_logits(runner, driver) -> torch.Tensor:
    """All prompts in one step; the logits of every prompt token [sum(lens), vocab]."""
    new_reqs = [driver.new(f"r{i}", p, len(p)) for i, p in enumerate(PROMPTS)]
    inputs = runner.prepare(runner.apply(driver.plan(new_reqs=new_reqs)))
    batch = dataclasses.replace(inputs.batch, logits_indices=torch.arange(inputs.batch.num_tokens))
    with torch.inference_mode():
        return runner.model(inputs.input_ids, inputs.positions, batch)


@pytest.mark.parametrize("arch", WINDOWED)
def test_long_prompt_logits_match_hf(arch, checkpoint_cache):
    hf_model, model_dir = checkpoint_cache(arch)
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS)
    logits = _prefill_logits(runner, PlanDriver(num_blocks=NUM_BLOCKS, seed=1,
                                                   num_kv_groups=runner.kv_cache.layout.num_groups))
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            expected.append(hf_model(torch.tensor([prompt])).logits[0])
    expected = torch.cat(expected)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # The windows matter here: the same model with every window dropped is far off.
    assert any(attn.window for attn in runner.model.attention_layers())
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS)
    for attn in runner.model.attention_layers():
        attn.window = 0
    unwindowed = _prefill_logits(runner, PlanDriver(num_blocks=NUM_BLOCKS, seed=1,
                                                   num_kv_groups=runner.kv_cache.layout.num_groups))
    assert (unwindowed - expected).abs().max() > 1e-2


@pytest.mark.parametrize("arch", WINDOWED)
def test_chunked_batched_greedy_matches_hf(arch, checkpoint_cache):
    """Every prompt prefilled in chunks of at most 24 tokens next to the others' decodes,
    then greedy decoding past the windows again."""
    hf_model, model_dir = checkpoint_cache(arch)
    num_new, chunk = 12, 24
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS)
    driver = PlanDriver(num_blocks=NUM_BLOCKS, seed=2,
                         num_kv_groups=runner.kv_cache.layout.num_groups)
    req_ids = [f"r{i}" for i in range(len(PROMPTS))]
    generated: dict[str, list[int]] = {r: [] for r in req_ids}
    prefilled = {r: min(chunk, len(p)) for r, p in zip(req_ids, PROMPTS, strict=True)}
    plan = driver.plan(new_reqs=[driver.new(r, p, prefilled[r])
                                 for r, p in zip(req_ids, PROMPTS, strict=True)])
    while any(len(g) < num_new for g in generated.values()):
        out = runner.execute(plan)
        driver.record(out.sampled)
        for req_id, ids in out.sampled:
            generated[req_id].extend(ids)
        cached, done = [], []
        for r, p in zip(req_ids, PROMPTS, strict=True):
            if prefilled[r] < len(p):
                step = min(chunk, len(p) - prefilled[r])
                prefilled[r] += step
                cached.append(driver.cached(r, step))
            elif len(generated[r]) < num_new:
                cached.extend(driver.decode_all([r]))
            elif r in runner.requests:
                done.append(r)
        plan = driver.plan(cached_reqs=cached, finished_req_ids=done)
    for req_id, prompt in zip(req_ids, PROMPTS, strict=True):
        assert generated[req_id][:num_new] == hf_greedy(hf_model, prompt, num_new), req_id
