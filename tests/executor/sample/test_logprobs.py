"""Top logprobs and scheduler-chosen tokens (append_sampled False): what beam search builds on.
HF's forward on the same tokens is the oracle."""

from __future__ import annotations

import pytest
import torch

from executor_svc.step.runner import PlanError
from protos.plan import CachedRequest, NewRequest, SamplingSpec
from tests.executor.harness import BLOCK_SIZE, PlanDriver, hf_top_logprobs, make_runner

PROMPTS = {"a": [5, 17, 29, 3, 88, 140, 2], "b": [7, 7, 8, 9, 250, 11, 12, 13, 14],
           "c": [33, 34], "d": [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72]}
SPECS = {"a": SamplingSpec(temperature=0.0, num_logprobs=5),
         "b": SamplingSpec(temperature=0.8, seed=3, num_logprobs=1),
         "c": SamplingSpec(temperature=0.0),
         "d": SamplingSpec(temperature=0.0, num_logprobs=20)}


def _assert_matches_hf(hf_model, token_ids, ids, logprobs):
    hf_ids, hf_values = hf_top_logprobs(hf_model, token_ids, len(ids))
    assert ids == hf_ids
    torch.testing.assert_close(torch.tensor(logprobs), hf_values, atol=1e-4, rtol=1e-4)


def test_top_logprobs_equal_hf_log_softmax(checkpoint_cache):
    hf_model, model_dir = checkpoint_cache("qwen2")
    runner, driver = make_runner(model_dir), PlanDriver(seed=31)
    tokens = {r: list(p) for r, p in PROMPTS.items()}
    plans = [dict(new_reqs=[driver.new(r, PROMPTS[r], 8 if r == "d" else len(PROMPTS[r]),
                                       SPECS[r]) for r in PROMPTS])]
    num_checked = 0
    for step in range(6):
        plan = (plans[0] if step == 0 else
                dict(cached_reqs=driver.decode_all(list(PROMPTS))))
        out = runner.execute(driver.plan(**plan))
        driver.record(out.sampled)
        sampled = dict(out.sampled)
        # Every sampling request with num_logprobs > 0 reports, with exactly that many.
        assert sorted(r for r, _, _ in out.logprobs) == sorted(
            r for r in sampled if SPECS[r].num_logprobs > 0)
        for req_id, ids, logprobs in out.logprobs:
            assert len(ids) == len(logprobs) == SPECS[req_id].num_logprobs
            _assert_matches_hf(hf_model, tokens[req_id], ids, logprobs)
            if SPECS[req_id].temperature == 0.0:
                assert sampled[req_id] == ids[:1]  # greedy takes the best logprob
            num_checked += 1
        for req_id, ids in out.sampled:
            tokens[req_id].extend(ids)
    assert num_checked == 3 * 6 - 1


def _step_to(driver, req_id: str, computed: int, new_token_ids: list[int]) -> CachedRequest:
    """A one-token step for a request whose tokens the scheduler chooses."""
    new_blocks = driver._grow(req_id, computed + 1)
    return CachedRequest(req_id=req_id, new_block_ids=new_blocks, num_computed_tokens=computed,
                         num_scheduled_tokens=1, new_token_ids=new_token_ids)


def test_chosen_tokens_and_a_forked_beam_follow_hf(checkpoint_cache):
    hf_model, model_dir = checkpoint_cache("llama3")
    runner, driver = make_runner(model_dir), PlanDriver(seed=32)
    spec = SamplingSpec(temperature=0.0, num_logprobs=4, append_sampled=False)
    prompt = [12, 40, 7, 99, 150, 3, 77]  # 9 tokens at the fork: a partial block to copy
    out = runner.execute(driver.plan(new_reqs=[driver.new("p", prompt, len(prompt), spec)]))
    paths = {"p": list(prompt)}
    for step in range(7):
        results = {r: (ids, lps) for r, ids, lps in out.logprobs}
        assert sorted(results) == sorted(paths) and sorted(dict(out.sampled)) == sorted(paths)
        for req_id, (ids, lps) in results.items():
            _assert_matches_hf(hf_model, paths[req_id], ids, lps)
            # The sampled token was not appended: the executor's copy is the chosen path.
            assert runner.requests[req_id].token_ids == paths[req_id]
        cached, new_reqs, copies = [], [], []
        if step == 2:
            # Fork p into q (a second beam): q shares p's full blocks, copies the partially
            # filled last one, and continues with p's second-best token.
            p_blocks, computed = driver.block_ids["p"], len(paths["p"])
            shared = p_blocks[:computed // BLOCK_SIZE]
            driver.block_ids["q"] = list(shared)
            assert computed % BLOCK_SIZE  # the prompt length makes the last block partial
            copy = driver.free.pop()
            copies.append((p_blocks[len(shared)], copy))
            driver.block_ids["q"].append(copy)
            driver._grow("q", computed + 1)
            paths["q"] = paths["p"] + [results["p"][0][1]]
            new_reqs.append(NewRequest(req_id="q", token_ids=paths["q"], sampling=spec,
                                       block_ids=list(driver.block_ids["q"]),
                                       num_computed_tokens=computed, num_scheduled_tokens=1))
        for req_id in [r for r in results if r not in {n.req_id for n in new_reqs}]:
            # Walk a path that is not the greedy one: rank 1, 2, 3, 1, ... of the top 4.
            choice = results[req_id][0][1 + step % 3]
            cached.append(_step_to(driver, req_id, len(paths[req_id]), [choice]))
            paths[req_id].append(choice)
        out = runner.execute(driver.plan(new_reqs=new_reqs, cached_reqs=cached,
                                         block_copies=copies))
    assert len(paths["q"]) == len(paths["p"]) == len(prompt) + 7 and paths["q"] != paths["p"]


def test_chosen_token_plans_are_checked(checkpoint_cache):
    _, model_dir = checkpoint_cache("llama3")
    runner, driver = make_runner(model_dir), PlanDriver(seed=33)
    chosen = SamplingSpec(temperature=0.0, append_sampled=False)
    out = runner.execute(driver.plan(new_reqs=[driver.new("s", [1, 2, 3], 3),
                                               driver.new("t", [4, 5, 6], 3, chosen)]))
    assert sorted(r for r, _ in out.sampled) == ["s", "t"] and out.logprobs == []
    assert runner.requests["s"].token_ids == [1, 2, 3, out.sampled[0][1][0]]
    assert runner.requests["t"].token_ids == [4, 5, 6]
    with pytest.raises(PlanError, match="appends this request's sampled tokens itself"):
        runner.execute(driver.plan(cached_reqs=[CachedRequest(req_id="s", new_block_ids=[],
                                                              num_computed_tokens=3,
                                                              num_scheduled_tokens=1,
                                                              new_token_ids=[9])]))
    with pytest.raises(PlanError, match="must send the next tokens in new_token_ids"):
        runner.execute(driver.plan(cached_reqs=[CachedRequest(req_id="t", new_block_ids=[],
                                                              num_computed_tokens=3,
                                                              num_scheduled_tokens=1)]))
    runner.execute(driver.plan(new_reqs=[driver.new("t", [4, 5, 6], 3, chosen)]))
    with pytest.raises(PlanError, match="outside the model's vocabulary"):
        runner.execute(driver.plan(cached_reqs=[CachedRequest(req_id="t", new_block_ids=[],
                                                              num_computed_tokens=3,
                                                              num_scheduled_tokens=1,
                                                              new_token_ids=[300])]))
    with pytest.raises(PlanError, match="num_logprobs 301 is outside 0..300"):
        runner.execute(driver.plan(new_reqs=[driver.new(
            "u", [1], 1, SamplingSpec(temperature=0.0, num_logprobs=301))]))


def _hf_log_softmax(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: HF's log_softmax in fp32 after each prefix."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def _rank(row: torch.Tensor, token_id: int) -> int:
    return int((row > row[token_id]).sum()) + 1


def test_sampled_logprob_and_rank_and_prompt_logprobs_across_chunks(checkpoint_cache):
    """Requests asking for the sampled token's logprob/rank and for prompt logprobs, next to one
    asking for nothing, with prompts computed in chunks of 3: against HF's forward."""
    hf_model, model_dir = checkpoint_cache("llama3")
    runner, driver = make_runner(model_dir), PlanDriver(seed=33)
    prompts = {"p": [5, 17, 29, 3, 88, 140, 2, 9, 41, 77], "s": [7, 8, 9, 250, 11, 12, 13],
               "o": [60, 61, 62, 63, 64]}
    specs = {"p": SamplingSpec(temperature=0.0, prompt_logprobs=4, sampled_logprob=True,
                               num_logprobs=3),
             "s": SamplingSpec(temperature=0.9, seed=5, sampled_logprob=True),
             "o": SamplingSpec(temperature=0.0)}
    chunk = 3
    new = [driver.new(r, prompts[r], min(chunk, len(prompts[r])), specs[r]) for r in prompts]
    out = runner.execute(driver.plan(new_reqs=new))
    tokens = {r: list(p) for r, p in prompts.items()}
    prompt_seen: dict[int, tuple] = {}
    num_sampled_checked = 0
    for _ in range(12):
        for entry in out.prompt_logprobs:
            assert entry.req_id == "p"
            for j, lp in enumerate(entry.token_logprobs):
                index = entry.start + j
                assert index not in prompt_seen, "a prompt position reported twice"
                prompt_seen[index] = (lp, entry.ranks[j], entry.top_ids[j], entry.top_logprobs[j])
        assert {r for r, _, _ in out.sampled_logprobs} == {r for r, _ in out.sampled} & {"p", "s"}
        sampled = dict(out.sampled)
        for req_id, lp, rank in out.sampled_logprobs:
            row = _hf_log_softmax(hf_model, tokens[req_id])[-1]
            token_id = sampled[req_id][0]
            assert abs(lp - float(row[token_id])) < 1e-4
            assert rank == _rank(row, token_id)
            num_sampled_checked += 1
        for req_id, ids in out.sampled:
            tokens[req_id].extend(ids)
        driver.record(out.sampled)
        cached = [driver.cached(r, min(chunk, driver.num_tokens[r] - driver.num_computed[r]))
                  for r in prompts]
        out = runner.execute(driver.plan(cached_reqs=cached))
    # Every prompt token but the first, once, equal to HF's forward over the prompt.
    assert sorted(prompt_seen) == list(range(1, len(prompts["p"])))
    hf = _hf_log_softmax(hf_model, prompts["p"])
    for index, (lp, rank, top_ids, top_lps) in prompt_seen.items():
        row = hf[index - 1]
        assert abs(lp - float(row[prompts["p"][index]])) < 1e-4
        assert rank == _rank(row, prompts["p"][index])
        values, ids = row.topk(4)
        assert top_ids == ids.tolist()
        torch.testing.assert_close(torch.tensor(top_lps), values, atol=1e-4, rtol=1e-4)
    assert num_sampled_checked >= 15
