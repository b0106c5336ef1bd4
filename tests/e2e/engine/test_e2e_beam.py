"""Beam search through the real server equals HF transformers' beam search, token for token.

Per architecture (two of them): one `folio serve`, and HF `generate(num_beams=k,
do_sample=False, num_return_sequences=n, length_penalty=..., early_stopping=...)` in fp32 on
the CPU as the oracle. Stop ids are tokens the model emits early, so beams finish at different
lengths and the early-stopping rules matter; the server gets them as stop_token_ids (with
ignore_eos) and HF as its eos_token_id list, which is the same stopping rule.
"""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncFolioClient
from tests.e2e.e2e_util import wait_idle
from tests.e2e.hf_oracle import hf_beam_search, hf_greedy, load_hf_model, random_prompts
from tests.fixtures.checkpoints import make_checkpoint

BLOCK_SIZE = 16
MAX_TOKENS = 12
FINISH = {1: "stop", 2: "length"}
# (beam_width, n, length_penalty, early_stopping, with stop ids)
CASES = [
    (2, 2, 1.0, "heuristic", True),
    (2, 1, 1.0, "heuristic", False),
    (4, 4, 2.0, "never", True),
    (4, 2, 0.5, "true", True),
    (4, 3, -1.0, "heuristic", True),
]
HF_EARLY_STOPPING = {"heuristic": False, "true": True, "never": "never"}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=("llama3", "qwen2"))
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(f"ckpt-beam-{request.param}"))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def server(folio_server, checkpoint):
    with folio_server(model=checkpoint, args=["--block-size", str(BLOCK_SIZE)]) as s:
        yield s


def hf_beams(model, prompt, beam_width, n, length_penalty, early_stopping, stop_ids):
    return hf_beam_search(model, prompt, beam_width, n, length_penalty,
                          HF_EARLY_STOPPING[early_stopping], stop_ids, MAX_TOKENS)[0]


async def folio_beams(client, prompt, beam_width, n, length_penalty, early_stopping,
                      stop_ids):
    finals = {}
    async for resp in client.generate(token_ids=prompt, beam_width=beam_width, n=n,
                                      length_penalty=length_penalty,
                                      early_stopping=early_stopping, max_tokens=MAX_TOKENS,
                                      stop_token_ids=sorted(stop_ids), ignore_eos=True):
        assert resp.finish_reason != 0, "beams are sent once, when the search ends"
        assert resp.index not in finals
        finals[resp.index] = resp
    assert sorted(finals) == list(range(n))
    return [finals[i] for i in range(n)]


async def test_beam_search_matches_hf(server, hf_model):
    prompts = random_prompts(hf_model.config.vocab_size, (9, 23), seed=11)
    greedy = hf_greedy(hf_model, prompts, 6)
    jobs = []  # (prompt, case, stop ids)
    for prompt, early in zip(prompts, greedy, strict=True):
        frequent = frozenset({early[2], early[5]})
        jobs += [(prompt, case, frequent if case[4] else frozenset()) for case in CASES]
    async with AsyncFolioClient(server.address, timeout=240) as client:
        got = await asyncio.gather(*[folio_beams(client, p, *case[:4], stops)
                                     for p, case, stops in jobs])
    mismatches = []
    for (prompt, case, stops), responses in zip(jobs, got, strict=True):
        expected = hf_beams(hf_model, prompt, *case[:4], stops)
        actual = [list(r.token_ids) for r in responses]
        if actual != expected:
            mismatches.append(f"len {len(prompt)} {case}: hf {expected} folio {actual}")
        for r, seq in zip(responses, actual, strict=True):
            assert FINISH[r.finish_reason] == ("stop" if seq[-1] in stops else "length")
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(seq))
    assert not mismatches, "\n".join(mismatches)
    # The cases exercise finishing: beams that stopped early and beams cut by max_tokens.
    lengths = {len(r.token_ids) for responses in got for r in responses}
    assert min(lengths) < MAX_TOKENS == max(lengths)
    wait_idle(server.address)  # every beam's blocks are back
