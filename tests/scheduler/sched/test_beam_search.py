"""`scheduler_svc.sched.beam_search` against HF transformers' own beam search.

Two drivers feed our bookkeeping the per-step logprobs of tiny random HF models:
- HF's logprobs themselves (`generate(..., output_scores=True)` returns each step's log_softmax
  for each running beam, in HF's beam order): our beams must be HF's beams in the same order,
  and sequences and scores must come out bit-equal;
- the model rerun on each of our beams' tokens (no HF beam state at all): token-exact.
Stop ids are tokens the model actually produces, so beams finish in the middle of the search.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from scheduler_svc.sched.beam_search import BeamSearch, EarlyStopping  # noqa: E402
from tests.e2e import hf_oracle  # noqa: E402
from tests.fixtures.checkpoints import make_checkpoint  # noqa: E402

ARCHS = ("llama2", "qwen3")
HF_EARLY_STOPPING = {EarlyStopping.HEURISTIC: False, EarlyStopping.TRUE: True,
                     EarlyStopping.NEVER: "never"}
# (beam_width, n, length_penalty, early_stopping, with stop ids)
CASES = [
    (2, 1, 1.0, EarlyStopping.HEURISTIC, False),
    (2, 2, 1.0, EarlyStopping.HEURISTIC, True),
    (2, 1, 0.0, EarlyStopping.NEVER, True),
    (4, 2, 0.5, EarlyStopping.TRUE, True),
    (4, 4, 2.0, EarlyStopping.NEVER, True),
    (4, 3, -1.0, EarlyStopping.HEURISTIC, True),
    (4, 1, 1.0, EarlyStopping.HEURISTIC, False),
]
PROMPTS = ([11, 200, 37, 1500, 999, 64, 7, 300], [1234, 5, 77])
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=ARCHS)
def hf_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(request.param, tmp_path_factory.mktemp(f"beam-{request.param}"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def frequent_stop_ids(model, prompt: list[int]) -> frozenset[int]:
    """Two tokens greedy decoding emits early: beams meet them within a few steps."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=6, eos_token_id=None, pad_token_id=4)
    generated = out[0, len(prompt):].tolist()
    return frozenset({generated[2], generated[5]})


def hf_beam_search(model, prompt, beam_width, n, length_penalty, early_stopping, stop_ids):
    return hf_oracle.hf_beam_search(model, prompt, beam_width, n, length_penalty,
                                    HF_EARLY_STOPPING[early_stopping], stop_ids, MAX_NEW_TOKENS)


def top_pairs(logprobs, k: int) -> list[tuple[int, float]]:
    values, indices = torch.topk(logprobs.float(), k)
    return list(zip(indices.tolist(), values.tolist(), strict=True))


def new_search(beam_width, length_penalty, early_stopping, stop_ids) -> BeamSearch:
    return BeamSearch(beam_width, MAX_NEW_TOKENS, stop_ids, length_penalty, early_stopping)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}-n{c[1]}-lp{c[2]}-{c[3].value}"
                         + ("-stops" if c[4] else ""))
@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
def test_bit_equal_to_hf_when_fed_hf_logprobs(hf_model, case, prompt):
    beam_width, n, length_penalty, early_stopping, with_stops = case
    stop_ids = frequent_stop_ids(hf_model, prompt) if with_stops else frozenset()
    expected, expected_scores, hf_steps = hf_beam_search(
        hf_model, prompt, beam_width, n, length_penalty, early_stopping, stop_ids)
    search = new_search(beam_width, length_penalty, early_stopping, stop_ids)
    num_steps = 0
    while not search.done:
        step_logprobs = hf_steps[num_steps]  # [beam_width, vocab], HF's beam order
        search.step([top_pairs(step_logprobs[i], search.num_candidates)
                     for i in range(len(search.beams))])
        num_steps += 1
    assert num_steps == len(hf_steps), "the search ended on a different step than HF's"
    best = search.best(n)
    assert [list(h.token_ids) for h in best] == expected
    assert [h.score for h in best] == expected_scores  # float32 rounding reproduced exactly
    for h in best:
        assert h.stopped == (h.token_ids[-1] in stop_ids)
        assert h.stopped or len(h.token_ids) == MAX_NEW_TOKENS


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5]],
                         ids=lambda c: f"k{c[0]}-n{c[1]}-lp{c[2]}-{c[3].value}")
def test_token_exact_when_fed_recomputed_logprobs(hf_model, case):
    """The scheduler's situation: logprobs come from running each of our beams, not from HF's
    beam state, so only the beam tokens tie the two runs together."""
    beam_width, n, length_penalty, early_stopping, _ = case
    prompt = PROMPTS[0]
    stop_ids = frequent_stop_ids(hf_model, prompt)
    expected, expected_scores, _ = hf_beam_search(
        hf_model, prompt, beam_width, n, length_penalty, early_stopping, stop_ids)
    search = new_search(beam_width, length_penalty, early_stopping, stop_ids)
    while not search.done:
        batch = torch.tensor([prompt + b.token_ids for b in search.beams])
        with torch.inference_mode():
            logprobs = torch.log_softmax(hf_model(batch).logits[:, -1].float(), dim=-1)
        search.step([top_pairs(row, search.num_candidates) for row in logprobs])
    best = search.best(n)
    assert [list(h.token_ids) for h in best] == expected
    assert [h.score for h in best] == pytest.approx(expected_scores, rel=1e-5, abs=1e-5)


def test_candidate_count_covers_every_stop_id():
    assert BeamSearch(4, 8, frozenset()).num_candidates == 8
    assert BeamSearch(4, 8, frozenset({1})).num_candidates == 8
    assert BeamSearch(3, 8, frozenset({1, 2, 3})).num_candidates == 12


def test_max_new_tokens_one_finishes_the_best_first_tokens():
    search = BeamSearch(2, 1, frozenset(), length_penalty=1.0)
    nxt = search.step([[(5, -0.1), (6, -0.5), (7, -2.0), (8, -3.0)]])
    assert nxt == [] and search.done
    assert [(h.token_ids, h.stopped) for h in search.best(2)] == [((5,), False), ((6,), False)]


def test_forks_and_drops_follow_the_candidates():
    search = BeamSearch(2, 10, frozenset({1}))
    assert [(b.parent, b.token_id) for b in search.step(
        [[(5, -0.1), (6, -0.2), (1, -3.0), (7, -4.0)]])] == [(0, 5), (0, 6)]
    # Beam 1 ("6") gets both continuations: beam 0 is dropped, beam 1 forks.
    nxt = search.step([[(9, -5.0), (1, -6.0), (8, -7.0), (2, -8.0)],
                       [(3, -0.1), (4, -0.2), (1, -9.0), (2, -9.5)]])
    assert [(b.parent, b.token_id) for b in nxt] == [(1, 3), (1, 4)]
    assert [b.token_ids for b in search.beams] == [[6, 3], [6, 4]]
    assert search.finished == []  # the stop candidates ranked below the best two


def test_rejects_a_search_that_cannot_run():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearch(0, 4, frozenset())
    with pytest.raises(ValueError, match="max_new_tokens"):
        BeamSearch(2, 0, frozenset())
