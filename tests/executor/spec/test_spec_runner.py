"""The executor's side of speculative decoding on a real tiny model: proposals verified in
one step against plain greedy decoding, rows settled so decoding goes on exactly, and plans
that propose for rows that may not speculate refused without harming the next plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.kv.kv_cache import KVCache
from executor_svc.loading.model_config import ModelConfig
from executor_svc.spec.draft import DraftProposer, load_draft
from executor_svc.step.runner import PlanError
from protos.plan import CachedRequest, SamplingSpec
from tests.executor.harness import PlanDriver, make_runner

PROMPT = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13]


def _greedy(model_dir, num_tokens: int) -> list[int]:
    runner, driver = make_runner(model_dir), PlanDriver(seed=3)
    out = runner.execute(driver.plan(new_reqs=[driver.new("x", PROMPT, len(PROMPT))]))
    driver.record(out.sampled)
    tokens = list(out.sampled[0][1])
    while len(tokens) < num_tokens:
        out = runner.execute(driver.plan(cached_reqs=driver.decode_all(["x"])))
        driver.record(out.sampled)
        tokens += out.sampled[0][1]
    return tokens


def _propose(driver: PlanDriver, req_id: str, proposals: list[int]) -> CachedRequest:
    computed = driver.num_computed[req_id]
    new = driver._grow(req_id, computed + 1 + len(proposals))
    return CachedRequest(req_id=req_id, new_block_ids=new, num_computed_tokens=computed,
                         num_scheduled_tokens=1 + len(proposals), new_token_ids=[],
                         spec_token_ids=proposals)


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_verified_proposals_continue_greedy_exactly(checkpoint_cache, arch):
    _, model_dir = checkpoint_cache(arch)
    expected = _greedy(model_dir, 12)
    runner, driver = make_runner(model_dir), PlanDriver(seed=4)
    out = runner.execute(driver.plan(new_reqs=[driver.new("x", PROMPT, len(PROMPT))]))
    driver.record(out.sampled)
    got = list(out.sampled[0][1])
    # Right proposals: all accepted, plus the next token. Wrong ones: only the target's token.
    # A partly right one: the right prefix, then the target's token.
    for proposals in (expected[1:4], [(expected[5] + 1) % 64, 0],
                      expected[6:8] + [(expected[8] + 1) % 64, 0]):
        plan = driver.plan(cached_reqs=[_propose(driver, "x", proposals)])
        out = runner.execute(plan)
        emitted = out.sampled[0][1]
        driver.record(out.sampled)
        driver.num_computed["x"] += len(emitted)
        got += emitted
        assert runner.requests["x"].num_computed_tokens == driver.num_computed["x"]
    assert len(got) == 1 + 4 + 1 + 3
    while len(got) < len(expected):  # plain decoding after the settled rows
        out = runner.execute(driver.plan(cached_reqs=driver.decode_all(["x"])))
        driver.record(out.sampled)
        got += out.sampled[0][1]
    assert got == expected


def test_refused_proposals_and_the_runner_goes_on(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama3")
    runner, driver = make_runner(model_dir), PlanDriver(seed=5)
    lp = SamplingSpec(temperature=0.0, num_logprobs=2)
    out = runner.execute(driver.plan(new_reqs=[driver.new("a", PROMPT, len(PROMPT), lp),
                                               driver.new("b", PROMPT, len(PROMPT))]))
    driver.record(out.sampled)
    with pytest.raises(PlanError, match="logprobs"):
        runner.execute(driver.plan(cached_reqs=[_propose(driver, "a", [1, 2])]))
    with pytest.raises(PlanError, match="vocabulary"):
        runner.execute(driver.plan(cached_reqs=[_propose(driver, "b", [1, 10**6])]))
    # A failed plan drops the requests it touched; a fresh one runs.
    assert "a" not in runner.requests and "b" not in runner.requests
    out = runner.execute(driver.plan(new_reqs=[driver.new("c", PROMPT, len(PROMPT))]))
    assert [r for r, _ in out.sampled] == ["c"]


def _with_draft(model_dir, num_layers, k=3):
    """A runner whose draft model is its own checkpoint (cut to num_layers, or whole)."""
    runner = make_runner(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    model, draft_cfg = load_draft(model_dir, cfg, num_layers, dtype=torch.float32,
                                  device=torch.device("cpu"), max_model_len=runner.max_model_len)
    kv = KVCache.allocate(draft_cfg, runner.kv_cache.num_blocks, runner.block_size,
                          torch.float32, torch.device("cpu"))
    model.bind_kv_cache(kv.per_layer())
    runner.draft = DraftProposer(model, kv, k, runner.max_model_len, torch.device("cpu"))
    return runner


def _decode_with_proposals(runner, driver, num_tokens: int, k: int = 3):
    """Plays the scheduler in draft mode: k lookahead slots per decode, the executor's last
    proposals sent back. Returns (tokens, steps, proposals accepted, proposals sent)."""
    out = runner.execute(driver.plan(new_reqs=[driver.new("x", PROMPT, len(PROMPT))]))
    driver.record(out.sampled)
    tokens, proposals, steps, accepted, sent = list(out.sampled[0][1]), [], 1, 0, 0
    while len(tokens) < num_tokens:
        held = len(driver.block_ids["x"])
        cached = _propose(driver, "x", proposals)
        driver._grow("x", driver.num_computed["x"] + 1 + len(proposals) + k)  # lookahead
        cached = cached._replace(new_block_ids=driver.block_ids["x"][held:])
        out = runner.execute(driver.plan(cached_reqs=[cached]))
        emitted = out.sampled[0][1]
        driver.record(out.sampled)
        driver.num_computed["x"] += len(emitted)
        accepted, sent = accepted + len(emitted) - 1, sent + len(proposals)
        proposals = dict(out.proposals).get("x", [])
        tokens += emitted
        steps += 1
    return tokens[:num_tokens], steps, accepted, sent


def test_draft_model_proposals(checkpoint_cache):
    """The whole model drafting for itself proposes exactly its own greedy continuation (every
    proposal accepted, k + 1 tokens a step); cut to one layer it proposes worse, and the
    output is still plain greedy's."""
    _, model_dir = checkpoint_cache("llama3")
    expected = _greedy(model_dir, 30)
    tokens, steps, accepted, sent = _decode_with_proposals(_with_draft(model_dir, None),
                                                          PlanDriver(seed=6), 30)
    assert tokens == expected
    assert accepted == sent > 0 and steps <= 2 + -(-(30 - 2) // 4)
    tokens, steps, accepted, sent = _decode_with_proposals(_with_draft(model_dir, 1),
                                                          PlanDriver(seed=7), 30)
    assert tokens == expected and sent > 0 and accepted <= sent


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(
    st.lists(st.integers(0, 400), max_size=6),  # proposals (the vocabulary is 300 tokens)
    st.integers(-2, 2),  # num_scheduled off by this from 1 + proposals
    st.booleans()),  # proposals for the logprobs row instead
    min_size=1, max_size=6))
def test_fuzzed_proposals_fail_cleanly_or_settle(fuzz_runner, steps):
    """Proposals of any length and ids, with any scheduled count, for a row that may or may
    not speculate: each plan either runs (the row settled: computed = held - 1, the emitted
    tokens its last ones) or fails with a PlanError; after a failure a fresh request runs."""
    runner = fuzz_runner
    runner.reset()
    driver = PlanDriver(seed=8)
    lp = SamplingSpec(temperature=0.0, num_logprobs=1)
    out = runner.execute(driver.plan(new_reqs=[driver.new("a", PROMPT, len(PROMPT)),
                                               driver.new("b", PROMPT, len(PROMPT), lp)]))
    driver.record(out.sampled)
    for proposals, off, on_b in steps:
        req_id = "b" if on_b else "a"
        if req_id not in runner.requests:
            break
        cached = _propose(driver, req_id, proposals)
        cached = cached._replace(num_scheduled_tokens=max(0, cached.num_scheduled_tokens + off))
        try:
            out = runner.execute(driver.plan(cached_reqs=[cached]))
        except PlanError:
            break
        if req_id not in dict(out.sampled):  # nothing scheduled: nothing changed
            assert cached.num_scheduled_tokens == 0
            continue
        emitted = dict(out.sampled)[req_id]
        assert 1 <= len(emitted) <= len(proposals) + 1
        assert emitted[:-1] == proposals[:len(emitted) - 1]
        state = runner.requests[req_id]
        assert state.num_computed_tokens == len(state.token_ids) - 1
        assert state.token_ids[-len(emitted):] == emitted
        driver.record(out.sampled)
        driver.num_computed[req_id] += len(emitted)
    fresh = runner.execute(PlanDriver(seed=9).plan(
        new_reqs=[PlanDriver(seed=9).new("z", PROMPT, len(PROMPT))], reset=True))
    assert [r for r, _ in fresh.sampled] == ["z"]


@pytest.fixture(scope="module")
def fuzz_runner(checkpoint_cache):
    return make_runner(checkpoint_cache("llama2")[1])


def test_draft_models_that_cannot_draft_are_refused(checkpoint_cache, tmp_path):
    _, model_dir = checkpoint_cache("llama3")
    cfg = ModelConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="--draft-layers 99: the draft model has only"):
        load_draft(model_dir, cfg, 99, dtype=torch.float32, device=cpu, max_model_len=64)
    other = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1)
    with pytest.raises(ValueError, match="must share the tokenizer"):
        load_draft(model_dir, other, None, dtype=torch.float32, device=cpu, max_model_len=64)


@pytest.mark.parametrize("num_prompt_chunk", [5, 0], ids=["mid-prompt", "decoding"])
def test_proposals_beside_a_row_with_prompt_logprobs(checkpoint_cache, num_prompt_chunk):
    """One step verifies "x"'s proposals while "p", asking for prompt logprobs, computes prompt
    positions or only decodes (its copy asks for them all its life). The step's logits rows
    are [sampling rows | prompt positions | proposals]; the prompt positions were written over
    the proposals' part too, which failed the step ("could not broadcast"). Now "x" emits
    what greedy decoding does, and "p" gets the same prompt logprobs as computed alone."""
    _, model_dir = checkpoint_cache("llama3")
    expected = _greedy(model_dir, 5)
    pl = SamplingSpec(temperature=0.0, prompt_logprobs=1)
    first = len(PROMPT) - num_prompt_chunk - 1 if num_prompt_chunk else len(PROMPT)

    def run(with_x: bool):
        runner, driver = make_runner(model_dir), PlanDriver(seed=6)
        new = [driver.new("p", PROMPT, first, pl)]
        if with_x:
            new.append(driver.new("x", PROMPT, len(PROMPT)))
        out = runner.execute(driver.plan(new_reqs=new))
        driver.record(out.sampled)
        lps = list(out.prompt_logprobs)
        cached = [driver.cached("p", num_prompt_chunk) if num_prompt_chunk
                  else driver.decode_all(["p"])[0]]
        if with_x:
            cached.append(_propose(driver, "x", expected[1:4]))
        out = runner.execute(driver.plan(cached_reqs=cached))
        lps += out.prompt_logprobs
        return dict(out.sampled), [(e.start, e.token_logprobs, e.top_ids) for e in lps
                                   if e.token_logprobs]

    sampled, lps = run(with_x=True)
    assert sampled["x"] == expected[1:5]  # all three accepted, plus the next token
    assert lps == run(with_x=False)[1]
