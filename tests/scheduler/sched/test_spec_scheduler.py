"""The scheduler's side of speculative decoding without an executor: which requests propose,
how many tokens, and the config's refusals."""

from __future__ import annotations

import pytest

from protos.plan import SamplingSpec
from scheduler_svc.config import SchedulerConfig, num_speculative_tokens
from scheduler_svc.sched.request import Request
from scheduler_svc.sched.speculation import proposal, speculates

LOOP = [5, 6, 7, 8] * 6  # a proposal for it is always the loop's continuation
GREEDY = SamplingSpec(temperature=0.0)


def _req(sampling: SamplingSpec = GREEDY, max_tokens: int = 100,
         outputs: int = 0) -> Request:
    req = Request("r", LOOP, sampling, max_tokens, 0)
    req.output_token_ids = LOOP[:outputs]
    return req


def test_proposal_follows_the_loop_and_its_limits():
    assert proposal(_req(), 3, 1000, 100) == [5, 6, 7]
    # max_tokens: 2 left, one of them the token the step samples anyway.
    assert proposal(_req(max_tokens=10, outputs=8), 3, 1000, 100) == [5]
    assert proposal(_req(max_tokens=10, outputs=9), 3, 1000, 100) == []
    # max_model_len: positions up to num_tokens - 1 + proposals are computed.
    num_tokens = len(LOOP) + 4
    assert proposal(_req(outputs=4), 3, num_tokens + 2, 100) == [5, 6]
    # The step's budget: the real token's position first.
    assert proposal(_req(), 3, 1000, 2) == [5]
    assert proposal(_req(), 3, 1000, 1) == []


@pytest.mark.parametrize("sampling", [
    SamplingSpec(num_logprobs=2), SamplingSpec(sampled_logprob=True),
    SamplingSpec(repetition_penalty=1.2), SamplingSpec(presence_penalty=0.5),
    SamplingSpec(min_p=0.1), SamplingSpec(logit_bias=((3, 1.0),)),
    SamplingSpec(allowed_token_ids=(5, 6)), SamplingSpec(bad_words=((5,),)),
    SamplingSpec(min_tokens=4, min_tokens_stop_ids=(2,)), SamplingSpec(append_sampled=False),
])
def test_requests_with_per_token_logits_work_do_not_speculate(sampling):
    assert not speculates(_req(sampling))
    assert proposal(_req(sampling), 3, 1000, 100) == []


def test_plain_sampling_speculates():
    assert speculates(_req(SamplingSpec(temperature=0.7, top_k=20, top_p=0.9, seed=3)))


def test_config_flags():
    assert num_speculative_tokens(SchedulerConfig()) == 0
    assert num_speculative_tokens(SchedulerConfig(speculative_method="ngram")) == 4
    assert num_speculative_tokens(SchedulerConfig(speculative_method="ngram",
                                                  num_speculative_tokens=2)) == 2
    with pytest.raises(ValueError, match="--speculative-method"):
        SchedulerConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match="need --speculative-method draft"):
        SchedulerConfig(speculative_method="ngram", speculative_draft_layers=2)
    with pytest.raises(ValueError, match="--speculative-draft-layers"):
        SchedulerConfig(speculative_method="draft", speculative_draft_layers=0)
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        SchedulerConfig(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="--num-speculative-tokens"):
        SchedulerConfig(speculative_method="ngram", num_speculative_tokens=0)


def test_serve_hands_the_draft_model_to_the_executor():
    flags = SchedulerConfig(speculative_method="draft", num_speculative_tokens=3,
                            speculative_model="/m/draft", speculative_draft_layers=2
                            ).executor_flags()
    assert flags[flags.index("--num-draft-tokens") + 1] == "3"
    assert flags[flags.index("--draft-model") + 1] == "/m/draft"
    assert flags[flags.index("--draft-layers") + 1] == "2"
    assert "--num-draft-tokens" not in SchedulerConfig(speculative_method="ngram").executor_flags()


def test_draft_proposals_are_used_only_right_after_they_were_made():
    req = _req()
    assert proposal(req, 3, 1000, 100, "draft") == []  # none made yet
    req.draft_proposals = (req.num_tokens, [1, 2, 3, 4])
    assert proposal(req, 3, 1000, 100, "draft") == [1, 2, 3]  # at most k
    assert proposal(req, 3, 1000, 3, "draft") == [1, 2]  # and what the budget leaves
    req.output_token_ids.append(5)  # a token since: they follow an older sequence
    assert proposal(req, 3, 1000, 100, "draft") == []


def test_no_proposals_while_the_executors_copy_asks_for_prompt_logprobs():
    """After its first token a request owes no prompt logprobs (its sampling stops asking),
    but the executor's copy asks until the request is sent again, and it verifies no proposals
    for it (SpecVerifier.refusal, which KVMirror applies): the scheduler proposed anyway, and
    the step failed. "x", beside it, speculates as before."""
    from tests.scheduler.kv_mirror import KVMirror, NullModel
    from tests.scheduler.sched.test_parallel_sampling import make_scheduler, run

    model = NullModel(tuple(range(10, 18)), context=1)  # its greedy runs loop at once
    sched = make_scheduler(num_speculative_tokens=3, speculative_method="ngram")
    mirror = KVMirror(4, model)
    asks = Request("p", LOOP, SamplingSpec(temperature=0.0, prompt_logprobs=1), 20, 0)
    sched.add_request(asks)
    sched.add_request(Request("x", LOOP, GREEDY, 20, 1))
    tokens, finished, _ = run(sched, mirror)
    expected = model.continuation(LOOP, GREEDY, 20, frozenset())
    assert tokens[("p", 0)] == tokens[("x", 0)] == expected
    assert len(asks.prompt_logprobs) == len(LOOP) - 1 and mirror.num_accepted > 0
