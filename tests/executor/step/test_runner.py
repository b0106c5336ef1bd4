"""The runner's plan handling: recompute preemption, seeded sampling, and refusing bad plans."""

from __future__ import annotations

import dataclasses

import pytest

from executor_svc.step.input_batch import INITIAL_CAPACITY
from executor_svc.step.runner import PlanError
from protos.plan import CachedRequest, NewRequest, SamplingSpec
from tests.executor.harness import BLOCK_SIZE, PlanDriver, make_runner

PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]
SEEDED = SamplingSpec(temperature=0.9, top_k=50, top_p=0.95, seed=7)


def _decode(runner, driver, req_ids, generated, num_steps):
    for _ in range(num_steps):
        out = runner.execute(driver.plan(cached_reqs=driver.decode_all(req_ids)))
        driver.record(out.sampled)
        for req_id, ids in out.sampled:
            generated.setdefault(req_id, []).extend(ids)


def test_seeded_output_survives_preemption_and_batch_changes(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama3")
    # Uninterrupted, alone.
    runner, driver = make_runner(model_dir), PlanDriver(seed=11)
    generated: dict[str, list[int]] = {}
    out = runner.execute(driver.plan(new_reqs=[driver.new("x", PROMPT, len(PROMPT), SEEDED)]))
    driver.record(out.sampled)
    generated["x"] = out.sampled[0][1]
    _decode(runner, driver, ["x"], generated, 9)
    expected = generated["x"]
    assert len(expected) == 10

    # With a neighbour, a chunked prefill, and a recompute preemption after 4 tokens.
    runner, driver = make_runner(model_dir), PlanDriver(seed=12)
    generated = {}
    out = runner.execute(driver.plan(new_reqs=[driver.new("x", PROMPT, 5, SEEDED),
                                               driver.new("y", [1, 2, 3], 3,
                                                          SamplingSpec(temperature=1.0))]))
    assert [r for r, _ in out.sampled] == ["y"]  # x is mid-prompt
    driver.record(out.sampled)
    generated["y"] = out.sampled[0][1]
    out = runner.execute(driver.plan(cached_reqs=[driver.cached("x", len(PROMPT) - 5)]
                                     + driver.decode_all(["y"])))
    driver.record(out.sampled)
    for req_id, ids in out.sampled:
        generated.setdefault(req_id, []).extend(ids)
    _decode(runner, driver, ["x", "y"], generated, 3)
    assert len(generated["x"]) == 4
    tokens = PROMPT + generated["x"]
    out = runner.execute(driver.plan(preempted_req_ids=["x"],
                                     cached_reqs=driver.decode_all(["y"])))
    driver.record(out.sampled)
    assert "x" not in runner.requests and len(generated["y"]) == 5
    out = runner.execute(driver.plan(new_reqs=[driver.new("x", tokens, len(tokens), SEEDED)]))
    driver.record(out.sampled)
    generated["x"].extend(out.sampled[0][1])
    _decode(runner, driver, ["x"], generated, 5)
    assert generated["x"] == expected


def test_bad_plans_fail_with_a_reason_and_drop_the_requests(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama2")
    runner, driver = make_runner(model_dir), PlanDriver(seed=13)
    out = runner.execute(driver.plan(new_reqs=[driver.new("a", PROMPT, len(PROMPT))]))
    driver.record(out.sampled)

    with pytest.raises(PlanError, match="no CPU swap pool"):
        runner.execute(driver.plan(swap_out=[(1, 0)]))
    with pytest.raises(PlanError, match="not held by the executor"):
        runner.execute(driver.plan(cached_reqs=[CachedRequest(req_id="nobody", new_block_ids=[],
                                                              num_computed_tokens=0,
                                                              num_scheduled_tokens=1)]))
    with pytest.raises(PlanError, match="block copy .* outside"):
        runner.execute(driver.plan(block_copies=[(0, 10_000)]))
    with pytest.raises(PlanError, match="scheduler counts 3 computed tokens"):
        runner.execute(driver.plan(cached_reqs=[CachedRequest(req_id="a", new_block_ids=[],
                                                              num_computed_tokens=3,
                                                              num_scheduled_tokens=1)]))
    # The failed step touched "a": its state is gone, so a later plan cannot silently reuse it.
    assert "a" not in runner.requests

    new = driver.new("b", PROMPT, len(PROMPT))
    too_many = dataclasses.replace(new, num_computed_tokens=0,
                                   num_scheduled_tokens=len(PROMPT) + 1)
    with pytest.raises(PlanError, match="exceeds its 11 tokens"):
        runner.execute(driver.plan(new_reqs=[too_many]))
    short = dataclasses.replace(new, block_ids=new.block_ids[:1], num_computed_tokens=0,
                                num_scheduled_tokens=len(PROMPT))
    with pytest.raises(PlanError, match="do not fit its 1 blocks"):
        runner.execute(driver.plan(new_reqs=[short]))
    bad_ids = dataclasses.replace(new, token_ids=[1, 2, 300], num_prompt_tokens=3,
                                  num_computed_tokens=0, num_scheduled_tokens=3)
    with pytest.raises(PlanError, match="outside the model's vocabulary of 300"):
        runner.execute(driver.plan(new_reqs=[bad_ids]))
    for spec, reason in ((SamplingSpec(logit_bias=((300, 1.0),)),
                          "logit_bias names token id 300"),
                         (SamplingSpec(bad_words=((5, 301),)), "bad_words names token id 301"),
                         (SamplingSpec(min_tokens=2, min_tokens_stop_ids=(300,)),
                          "min_tokens_stop_ids names"),
                         (SamplingSpec(allowed_token_ids=(1, 999)), "allowed_token_ids names"),
                         (SamplingSpec(repetition_penalty=0.0), "repetition_penalty > 0"),
                         (SamplingSpec(min_p=float("nan")), "must be finite")):
        bad_spec = dataclasses.replace(new, sampling=spec, num_computed_tokens=0,
                                       num_scheduled_tokens=len(PROMPT))
        with pytest.raises(PlanError, match=reason):
            runner.execute(driver.plan(new_reqs=[bad_spec]))
    # A well-formed plan still runs afterwards; an empty one computes nothing.
    assert runner.execute(driver.plan(new_reqs=[new])).sampled[0][0] == "b"
    assert runner.execute(driver.plan(finished_req_ids=["b"])).sampled == []
    assert runner.requests == {}


def test_plans_that_do_not_fit_a_row_are_refused(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama2")
    runner, driver = make_runner(model_dir), PlanDriver(seed=14)
    max_len = runner.max_model_len
    new = driver.new("a", PROMPT, len(PROMPT))
    long = NewRequest(req_id="a", token_ids=[1] * (max_len + 2), sampling=new.sampling,
                      block_ids=new.block_ids, num_computed_tokens=0, num_scheduled_tokens=1)
    with pytest.raises(PlanError, match=f"{max_len + 2} tokens held exceed max_model_len"):
        runner.execute(driver.plan(new_reqs=[long]))
    wide = NewRequest(req_id="a", token_ids=PROMPT, sampling=new.sampling,
                      block_ids=[0] * (max_len // BLOCK_SIZE + 1), num_computed_tokens=0,
                      num_scheduled_tokens=1)
    with pytest.raises(PlanError, match="blocks exceed the .* that max_model_len"):
        runner.execute(driver.plan(new_reqs=[wide]))
    with pytest.raises(PlanError, match="request a appears twice in one plan"):
        again = CachedRequest(req_id="a", new_block_ids=[], num_computed_tokens=0,
                              num_scheduled_tokens=1)
        runner.execute(driver.plan(new_reqs=[new], cached_reqs=[again]))
    assert runner.requests == {}


def test_more_requests_than_rows_each_decode_as_if_alone(checkpoint_cache):
    # More requests than the persistent batch's first capacity, finishing and arriving at
    # different steps so rows are freed, reused and the arrays grow while requests are held.
    _, model_dir = checkpoint_cache("llama2")
    prompts = {f"r{i}": [(7 * i + j) % 290 + 1 for j in range(3 + i % 5)]
               for i in range(INITIAL_CAPACITY + 12)}
    num_new = {req_id: 2 + i % 4 for i, req_id in enumerate(prompts)}

    def run(req_ids_by_step: list[list[str]], num_blocks: int):
        runner, driver = make_runner(model_dir, num_blocks), PlanDriver(num_blocks, seed=15)
        generated: dict[str, list[int]] = {}
        running: list[str] = []
        step = 0
        while step < len(req_ids_by_step) or running:
            arriving = req_ids_by_step[step] if step < len(req_ids_by_step) else []
            done = [r for r in running if len(generated[r]) >= num_new[r]]
            running = [r for r in running if r not in done]
            out = runner.execute(driver.plan(
                new_reqs=[driver.new(r, prompts[r], len(prompts[r])) for r in arriving],
                cached_reqs=driver.decode_all(running), finished_req_ids=done))
            driver.record(out.sampled)
            for req_id, ids in out.sampled:
                generated.setdefault(req_id, []).extend(ids)
            running += arriving
            step += 1
        assert runner.requests == {}  # every row was freed by the last plan
        return generated, runner.input_batch.capacity

    names = list(prompts)
    together, capacity = run([names[:INITIAL_CAPACITY - 4], [], names[INITIAL_CAPACITY - 4:]],
                             400)
    assert capacity > INITIAL_CAPACITY
    for req_id in names:
        alone, _ = run([[req_id]], 16)
        assert together[req_id][:num_new[req_id]] == alone[req_id][:num_new[req_id]]
