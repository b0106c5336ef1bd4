"""Stop strings, stop ids and matched_stop through the real server and executor (the tiny
random-weight model), with overlapped scheduling on (the shared default server) and off.

The oracle is a free run of the same request without stops (greedy, or seeded: the same
tokens): its per-token text deltas go through the brute-force reference of
tests/scheduler/text/test_stop_strings.py, which says where the stopped run must end, with which
text and which stop string. The stopped run must stream exactly the free run's tokens up to and
including the one that completed the stop (never a token computed past it, which overlapped
scheduling does compute), and no message may show text that the final text does not have.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from client import FolioClient
from protos.folio.v1 import generator_pb2 as pb
from tests.conftest import TINY_RANDOM
from tests.e2e.e2e_util import wait_idle
from tests.scheduler.text.test_stop_strings import reference

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The harbor was quiet", "Once upon a time", "def main():", "Numbers: 1, 2,"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def lockstep_server(folio_server):
    with folio_server(model=TINY_RANDOM, args=["--no-overlap-scheduling"]) as s:
        yield s


@pytest.fixture(params=["overlap", "lockstep"])
def server(request, default_server, lockstep_server):
    return default_server if request.param == "overlap" else lockstep_server


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def stream(address: str, **kwargs) -> dict[int, dict]:
    """Every sequence of one request: per-token text deltas, the text shown after each
    message, tokens, finish reason and matched stop."""
    seqs: dict[int, dict] = defaultdict(lambda: dict(deltas=[], shown=[], text="", tokens=[],
                                                     finish=None, matched=None))
    with FolioClient(address, timeout=120) as client:
        for resp in client.generate(**kwargs):
            seq = seqs[resp.index]
            assert seq["finish"] is None, "a message after the sequence's last one"
            if resp.token_ids:
                seq["deltas"] += [""] * (len(resp.token_ids) - 1) + [resp.text]
            elif resp.text:
                seq["deltas"][-1] += resp.text  # the final flush (no new token)
            seq["tokens"] += resp.token_ids
            seq["text"] += resp.text
            seq["shown"].append(seq["text"])
            if resp.finish_reason:
                seq["finish"] = pb.FinishReason.Name(resp.finish_reason)
                which = resp.WhichOneof("matched_stop")
                seq["matched"] = getattr(resp, which) if which else None
    return dict(seqs)


def pick(text: str, at: int, size: int) -> str:
    """`size` characters of `text` from `at` on that a tokenizer spells cleanly (no U+FFFD of
    a byte the random model wrote alone)."""
    for i in range(at, len(text) - size):
        if "\ufffd" not in text[i:i + size]:
            return text[i:i + size]
    raise AssertionError(f"no clean {size} characters in {text!r}")


def stops_from(text: str, seed: int) -> list[str]:
    """Stop strings for a text: a few characters from its middle (they occur), plus one that
    cannot occur."""
    return [pick(text, len(text) // 2 + seed % 5, 3 + seed % 3), "\x00never"]


def check_against_free_run(free: dict, stopped: dict, stop: list[str], include: bool) -> None:
    want_text, want_match, num_tokens = reference(free["deltas"], stop, include)
    assert stopped["text"] == want_text
    assert stopped["matched"] == want_match
    assert stopped["tokens"] == free["tokens"][:num_tokens]  # none computed past the stop
    assert stopped["finish"] == ("FINISH_REASON_STOP" if want_match else free["finish"])
    for shown in stopped["shown"]:  # nothing shown is ever taken back
        assert want_text.startswith(shown)


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_greedy_stops_like_the_reference(server, include):
    matched = 0
    for i, prompt in enumerate(PROMPTS):
        common = dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        [free] = stream(server.address, **common).values()
        stop = stops_from(free["text"], i)
        [stopped] = stream(server.address, stop=stop, include_stop_str_in_output=include,
                           **common).values()
        check_against_free_run(free, stopped, stop, include)
        matched += stopped["matched"] is not None
    assert matched == len(PROMPTS)
    wait_idle(server.address)


def test_stop_strings_wait_for_min_tokens(server):
    """A stop string is only checked once min_tokens tokens are out (vLLM): one that occurs
    in the first tokens does not end the sequence there."""
    checked = 0
    for prompt in PROMPTS:
        common = dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        [free] = stream(server.address, **common).values()
        early = "".join(free["deltas"][:4])
        if len(early) < 2 or "\ufffd" in early[-2:]:
            continue
        stop = [early[-2:]]
        assert reference(free["deltas"], stop, False)[2] <= 4  # would stop early without
        [stopped] = stream(server.address, stop=stop, min_tokens=12, **common).values()
        want_text, want_match, num_tokens = reference(free["deltas"], stop, False, 12)
        assert num_tokens > 12 or want_match is None
        assert stopped["text"] == want_text and stopped["matched"] == want_match
        assert stopped["tokens"] == free["tokens"][:num_tokens]
        checked += 1
    assert checked >= 2
    wait_idle(server.address)


def test_n_sequences_stop_each_on_its_own(server):
    common = dict(prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.9, seed=7, n=3,
                  ignore_eos=True)
    free = stream(server.address, **common)
    # One stop string per sequence, from its own text: each cuts its sequence (or a sibling's,
    # if that text holds it too); the reference says which, per sequence.
    stop = [stops_from(free[i]["text"], i)[0] for i in range(3)]
    stopped = stream(server.address, stop=stop, **common)
    assert sorted(stopped) == [0, 1, 2]
    for i in range(3):
        check_against_free_run(free[i], stopped[i], stop, include=False)
        assert stopped[i]["matched"] is not None
    wait_idle(server.address)


def test_a_partial_stop_is_held_then_released_when_it_cannot_match(server):
    common = dict(prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    [free] = stream(server.address, **common).values()
    # The text of tokens 5..12 then a character the model never writes: held while the text
    # follows it, released once it diverges.
    start = len("".join(free["deltas"][:5]))
    prefix = "".join(free["deltas"][5:13])
    [stopped] = stream(server.address, stop=[prefix + "\x00"], **common).values()
    assert stopped["finish"] == "FINISH_REASON_LENGTH" and stopped["matched"] is None
    assert stopped["text"] == free["text"] and stopped["tokens"] == free["tokens"]
    # While the text followed the stop string, nothing past `start` was shown.
    assert all(len(shown) <= start for shown in stopped["shown"][5:13])


def test_stop_token_ids_report_the_id_and_hide_its_text(server, hf_tokenizer):
    common = dict(prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    [free] = stream(server.address, **common).values()
    tokens = free["tokens"]
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    for include in (False, True):
        [stopped] = stream(server.address, stop_token_ids=[tokens[k]],
                           include_stop_str_in_output=include, **common).values()
        assert stopped["finish"] == "FINISH_REASON_STOP" and stopped["matched"] == tokens[k]
        assert stopped["tokens"] == tokens[:k + 1]
        shown = tokens[:k + 1] if include else tokens[:k]
        assert stopped["text"] == hf_tokenizer.decode(shown, skip_special_tokens=True)
    assert free["matched"] is None and free["finish"] == "FINISH_REASON_LENGTH"


def test_beams_finish_on_stop_strings(server, hf_tokenizer):
    # length_penalty 0: a hypothesis scores its summed logprob, so one that stopped early
    # outranks the longer ones and is returned.
    common = dict(prompt=PROMPTS[3], max_tokens=12, beam_width=3, n=3, ignore_eos=True,
                  length_penalty=0.0)
    free = stream(server.address, **common)
    text = free[0]["text"]
    stop = [pick(text, len(text) // 3, 3)]  # occurs in the best beam's text
    stopped = stream(server.address, stop=stop, **common)
    assert sorted(stopped) == [0, 1, 2]
    for seq in stopped.values():
        full = hf_tokenizer.decode(seq["tokens"], skip_special_tokens=True)
        before = hf_tokenizer.decode(seq["tokens"][:-1], skip_special_tokens=True)
        assert stop[0] not in before  # a beam ends at the token that completes a stop
        if seq["matched"] is not None:
            assert seq["finish"] == "FINISH_REASON_STOP" and seq["matched"] == stop[0]
            assert full.startswith(seq["text"] + stop[0])
            assert seq["text"] == full[:full.index(stop[0])]
        else:
            assert seq["finish"] == "FINISH_REASON_LENGTH" and len(seq["tokens"]) == 12
            assert stop[0] not in full and seq["text"] == full
    assert any(seq["matched"] is not None for seq in stopped.values())
    wait_idle(server.address)


def test_max_tokens_zero_is_the_rest_of_the_context(default_server):
    with FolioClient(default_server.address, timeout=120) as client:
        max_model_len = client.model_info()["max_model_len"]
        prompt = [7 + i % 100 for i in range(max_model_len - 5)]
        for max_tokens in (0, None):
            done = client.generate_text(token_ids=prompt, max_tokens=max_tokens,
                                        ignore_eos=True)
            assert done.finish_reason == "length" and done.matched_stop is None
            assert len(done.token_ids) == done.usage["completion_tokens"] == 5


def test_overlap_on_and_off_give_the_same_streams(default_server, lockstep_server):
    requests = [dict(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                     stop=[" the", "e,", "\n"]) for p in PROMPTS]
    requests.append(dict(prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                         n=2, ignore_eos=True, stop=["a", "o"]))
    for kwargs in requests:
        overlapped = stream(default_server.address, **kwargs)
        lockstep = stream(lockstep_server.address, **kwargs)
        assert overlapped == lockstep, kwargs
