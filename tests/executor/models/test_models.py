"""Our models against HF transformers, through the paged KV cache and real step plans (every
harness architecture, and gpt-oss with MXFP4 experts against HF's own dequantization of them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from protos.plan import NewRequest, SamplingSpec
from tests.executor.harness import ARCHS, MXFP4_ARCH, PlanDriver, hf_greedy, make_runner

PROMPTS = [
    [5, 17, 42, 99, 7, 250, 3],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [200, 1, 150, 33, 87, 45, 66, 71, 299, 8, 120, 9, 64, 32, 16, 4, 2, 77, 88, 91, 10, 5],
    [42],
]


@pytest.mark.parametrize("arch", [*ARCHS, MXFP4_ARCH])
def test_prefill_logits_match_hf(arch, checkpoint_cache):
    hf_model, model_dir = checkpoint_cache(arch)
    runner = make_runner(model_dir)
    driver = PlanDriver(seed=1, num_kv_groups=runner.kv_cache.layout.num_groups)
    # One batch of prompts of different lengths, on shuffled blocks.
    new_reqs = [driver.new(f"r{i}", prompt, len(prompt)) for i, prompt in enumerate(PROMPTS)]
    inputs = runner.prepare(runner.apply(driver.plan(new_reqs=new_reqs)))
    input_ids, positions, batch = inputs.input_ids, inputs.positions, inputs.batch
    # Ask for the logits of every token row, not just the last of each prompt.
    batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    with torch.inference_mode():
        logits = runner.model(input_ids, positions, batch)  # [num_tokens, vocab]
    start = 0
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]  # [len, vocab]
        got = logits[start:start + len(prompt)]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        start += len(prompt)


@pytest.mark.parametrize("arch", [*ARCHS, MXFP4_ARCH])
def test_greedy_generation_matches_hf(arch, checkpoint_cache):
    hf_model, model_dir = checkpoint_cache(arch)
    num_new = 16
    runner = make_runner(model_dir)
    # Windows are honoured, never a cap on the context (mistral's is 8).
    assert runner.max_model_len == 256
    driver = PlanDriver(seed=2, num_kv_groups=runner.kv_cache.layout.num_groups)
    req_ids = [f"r{i}" for i in range(len(PROMPTS))]
    generated: dict[str, list[int]] = {r: [] for r in req_ids}

    def run(plan):
        out = runner.execute(plan)
        driver.record(out.sampled)
        for req_id, ids in out.sampled:
            generated[req_id].extend(ids)
        return out

    # Step 0: r0, r1, r3 whole; r2 only its first 9 tokens (a chunked prefill).
    first = [driver.new(r, p, len(p)) for r, p in zip(req_ids, PROMPTS, strict=True) if r != "r2"]
    first.append(driver.new("r2", PROMPTS[2], 9))
    out = run(driver.plan(new_reqs=first))
    assert sorted(r for r, _ in out.sampled) == ["r0", "r1", "r3"]  # r2 is mid-prompt
    # Step 1: the rest of r2's prompt alongside decode steps of the others.
    cached = driver.decode_all(["r0", "r1", "r3"])
    cached.append(driver.cached("r2", len(PROMPTS[2]) - 9))
    run(driver.plan(cached_reqs=cached))
    while any(len(g) < num_new for g in generated.values()):
        active = [r for r in req_ids if len(generated[r]) < num_new]
        done = [r for r in req_ids if len(generated[r]) >= num_new and r in runner.requests]
        run(driver.plan(cached_reqs=driver.decode_all(active), finished_req_ids=done))
    for req_id, prompt in zip(req_ids, PROMPTS, strict=True):
        assert generated[req_id][:num_new] == hf_greedy(hf_model, prompt, num_new), req_id


def test_prefix_hit_with_copy_on_write_matches_recompute(checkpoint_cache):
    """A new request that reuses another's blocks (num_computed_tokens > 0) plus a block copy
    for the shared partial block samples what a full recompute samples."""
    hf_model, model_dir = checkpoint_cache("llama2")
    runner = make_runner(model_dir)
    driver = PlanDriver(seed=3)
    prompt = PROMPTS[2]  # 22 tokens: 5 full blocks of 4 and 2 tokens in the 6th
    out = runner.execute(driver.plan(new_reqs=[driver.new("a", prompt, len(prompt))]))
    blocks_a = driver.block_ids["a"]
    # "b" shares the first 5 blocks and a private copy of the 6th, holding 21 computed tokens.
    cow_block = driver.free.pop()
    shared = blocks_a[:5] + [cow_block]
    b_prompt = prompt[:21] + [123]
    plan = driver.plan(new_reqs=[NewRequest(req_id="b", token_ids=b_prompt,
                                            sampling=SamplingSpec(temperature=0.0),
                                            block_ids=shared, num_computed_tokens=21,
                                            num_scheduled_tokens=1)],
                       block_copies=[(blocks_a[5], cow_block)])
    out_b = runner.execute(plan)
    expected = hf_greedy(hf_model, b_prompt, 1)
    assert out_b.sampled == [("b", expected)]
    assert out.sampled == [("a", hf_greedy(hf_model, prompt, 1))]
