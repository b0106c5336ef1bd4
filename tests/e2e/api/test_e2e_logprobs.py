"""logprobs and prompt_logprobs through the real server and executor, against HF transformers.

The oracle is HF's forward in fp32 over prompt + generated tokens (teacher forcing):
log_softmax of its logits at position i is the distribution the token at i + 1 was drawn from.
Prompts are computed in chunks (a batch budget of 24 tokens, so a prompt spans several
steps), next to requests that ask for nothing. A server with a KV pool too small for all the
requests preempts by recompute and must report exactly what an unpreempted server reports,
with the prompt's logprobs on one message only.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch

from client import AsyncFolioClient
from client.messages import generate_request, token_logprobs_dict
from tests.e2e.hf_oracle import load_hf_model, random_prompts
from tests.fixtures.checkpoints import make_checkpoint

BUDGET = ["--max-num-batched-tokens", "24", "--block-size", "16"]
LENGTHS = (1, 2, 17, 40, 57, 90)
MAX_TOKENS = 12
K = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("llama3", tmp_path_factory.mktemp("ckpt-logprobs"))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def server(folio_server, checkpoint):
    with folio_server(model=checkpoint, args=BUDGET) as s:
        yield s


@pytest.fixture(scope="module")
def small_pool_server(folio_server, checkpoint):
    args = [*BUDGET, "--num-kv-blocks", "12", "--preemption-mode", "recompute"]
    with folio_server(model=checkpoint, args=args) as s:
        yield s


def hf_log_softmax(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row i is the distribution of token i + 1."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_entry(entry: dict, row: torch.Tensor, token_id: int, k: int) -> None:
    assert entry["token_id"] == token_id
    assert abs(entry["logprob"] - float(row[token_id])) < 1e-4
    assert entry["rank"] == int((row > row[token_id]).sum()) + 1
    values, ids = row.topk(k)
    assert [a["token_id"] for a in entry["top_logprobs"]] == ids.tolist()
    torch.testing.assert_close(torch.tensor([a["logprob"] for a in entry["top_logprobs"]]),
                               values, atol=1e-4, rtol=0)


def assert_close_entries(got: list[dict], want: list[dict]) -> None:
    """The same tokens, ranks and alternatives; values equal up to the float noise of a
    different batch composition or chunking (the model's matmuls and attention see other
    shapes): the tolerance the HF comparisons use. Ranks deeper than the alternatives any
    request may ask for (20) may move by one place: among a vocabulary's tail, neighbouring
    logprobs lie closer together than that noise."""
    def ids(entries):
        return [(e["token_id"], e["rank"] if e["rank"] <= 20 else None,
                 [a["token_id"] for a in e["top_logprobs"]]) for e in entries]

    for g, w in zip(got, want, strict=True):
        assert abs(g["rank"] - w["rank"]) <= (0 if min(g["rank"], w["rank"]) <= 20 else 1)

    def values(entries):
        return [v for e in entries for v in (e["logprob"], *(a["logprob"] for a in
                                                             e["top_logprobs"]))]

    assert ids(got) == ids(want)
    torch.testing.assert_close(torch.tensor(values(got)), torch.tensor(values(want)),
                               atol=1e-4, rtol=0)


async def stream(address: str, **kwargs) -> tuple[list, list]:
    """(every message of the stream, the messages that carried prompt_logprobs)."""
    async with AsyncFolioClient(address, timeout=240) as client:
        messages = [m async for m in client.generate(**kwargs)]
    return messages, [m for m in messages if len(m.prompt_logprobs)]


def fold(messages) -> dict[int, tuple[list[int], list[dict]]]:
    """index -> (token ids, logprob entries), checking they line up in every message."""
    out: dict[int, tuple[list[int], list[dict]]] = {}
    for m in messages:
        assert len(m.logprobs) == len(m.token_ids)  # one entry per token, in every message
        token_ids, entries = out.setdefault(m.index, ([], []))
        token_ids += m.token_ids
        entries += map(token_logprobs_dict, m.logprobs)
    return out


async def test_greedy_logprobs_and_prompt_logprobs_equal_hf(server, hf_model):
    prompts = random_prompts(hf_model.config.vocab_size, LENGTHS, seed=7)
    async with AsyncFolioClient(server.address, timeout=240) as client:
        asked = [client.generate_text(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS,
                                      ignore_eos=True, logprobs=K, prompt_logprobs=K)
                 for p in prompts]
        plain = [client.generate_text(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS,
                                      ignore_eos=True) for p in prompts]
        done = await asyncio.gather(*asked, *plain)
    for prompt, c, bare in zip(prompts, done[:len(prompts)], done[len(prompts):], strict=True):
        assert c.token_ids == bare.token_ids  # asking changes nothing about the tokens
        assert bare.logprobs is None and bare.prompt_logprobs is None
        full = prompt + c.token_ids
        rows = hf_log_softmax(hf_model, full)
        assert len(c.logprobs) == MAX_TOKENS
        for i, entry in enumerate(c.logprobs):
            position = len(prompt) + i - 1
            assert_entry(entry, rows[position], full[position + 1], K)
            assert entry["rank"] == 1  # greedy takes the most likely token
        # Every prompt token but the first, in order, given the tokens before it.
        assert len(c.prompt_logprobs or []) == len(prompt) - 1
        for i, entry in enumerate(c.prompt_logprobs or []):
            assert_entry(entry, rows[i], prompt[i + 1], K)


async def test_logprobs_zero_gives_own_logprob_and_rank_only(server, hf_model):
    prompt = random_prompts(hf_model.config.vocab_size, (30,), seed=8)[0]
    async with AsyncFolioClient(server.address, timeout=240) as client:
        c = await client.generate_text(token_ids=prompt, temperature=0.0, max_tokens=4,
                                       ignore_eos=True, logprobs=0, prompt_logprobs=0)
    rows = hf_log_softmax(hf_model, prompt + c.token_ids)
    for i, entry in enumerate(c.logprobs):
        assert_entry(entry, rows[len(prompt) + i - 1], c.token_ids[i], 0)
    for i, entry in enumerate(c.prompt_logprobs):
        assert_entry(entry, rows[i], prompt[i + 1], 0)


async def test_seeded_sampling_reports_the_raw_distribution(server, hf_model):
    """Sampled (not greedy) tokens: each reported logprob and rank is the drawn token's in the
    raw distribution (before temperature and top-k), and a seeded rerun reports the same."""
    prompt = random_prompts(hf_model.config.vocab_size, (20,), seed=9)[0]
    kwargs = dict(token_ids=prompt, temperature=1.5, top_k=40, seed=1234, max_tokens=16,
                  ignore_eos=True, logprobs=3)
    async with AsyncFolioClient(server.address, timeout=240) as client:
        first, again = await asyncio.gather(client.generate_text(**kwargs),
                                            client.generate_text(**kwargs))
    assert first.token_ids == again.token_ids
    assert_close_entries(first.logprobs, again.logprobs)
    rows = hf_log_softmax(hf_model, prompt + first.token_ids)
    for i, entry in enumerate(first.logprobs):
        assert_entry(entry, rows[len(prompt) + i - 1], first.token_ids[i], 3)
    assert any(e["rank"] > 1 for e in first.logprobs)  # it did sample, at temperature 1.5


async def test_logprobs_stay_raw_under_the_logits_processors(server, hf_model):
    """Penalties, a bias and min_p change which token is drawn, not what is reported: the
    raw distribution at each position, the drawn token's place in it."""
    prompt = random_prompts(hf_model.config.vocab_size, (25,), seed=13)[0]
    async with AsyncFolioClient(server.address, timeout=240) as client:
        c = await client.generate_text(
            token_ids=prompt, temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=4,
            repetition_penalty=1.8, frequency_penalty=1.0, min_p=0.05,
            logit_bias={prompt[3]: 5.0})
    rows = hf_log_softmax(hf_model, prompt + c.token_ids)
    for i, entry in enumerate(c.logprobs):
        assert_entry(entry, rows[len(prompt) + i - 1], c.token_ids[i], 4)


async def test_preemption_and_n_report_what_an_unpreempted_run_reports(
        server, small_pool_server, hf_model):
    prompts = random_prompts(hf_model.config.vocab_size, (40, 57, 90, 33), seed=10)

    async def run(address: str) -> list:
        return await asyncio.gather(*[
            stream(address, token_ids=p, temperature=0.8, seed=i, n=2, max_tokens=MAX_TOKENS,
                   ignore_eos=True, logprobs=2, prompt_logprobs=3)
            for i, p in enumerate(prompts)])

    expected, got = await run(server.address), await run(small_pool_server.address)
    async with AsyncFolioClient(small_pool_server.address) as client:
        assert (await client.stats())["num_preemptions"] > 0
    for prompt, (want, want_pl), (have, have_pl) in zip(prompts, expected, got, strict=True):
        have_seqs, want_seqs = fold(have), fold(want)
        assert sorted(have_seqs) == sorted(want_seqs) == [0, 1]
        for index, (token_ids, entries) in have_seqs.items():
            assert token_ids == want_seqs[index][0] and len(entries) == MAX_TOKENS
            assert_close_entries(entries, want_seqs[index][1])
        # Prompt logprobs once, on index 0's first message, whatever was recomputed.
        assert len(have_pl) == len(want_pl) == 1
        assert have_pl[0] is next(m for m in have if m.index == 0)
        assert_close_entries(list(map(token_logprobs_dict, have_pl[0].prompt_logprobs)),
                             list(map(token_logprobs_dict, want_pl[0].prompt_logprobs)))
        assert len(have_pl[0].prompt_logprobs) == len(prompt) - 1
        rows = hf_log_softmax(hf_model, prompt)
        for i, t in enumerate(have_pl[0].prompt_logprobs):
            assert abs(t.logprob - float(rows[i][prompt[i + 1]])) < 1e-4


@pytest.mark.parametrize(("sampling", "message"), [
    (dict(logprobs=21), "logprobs must be between 0 and 20"),
    (dict(prompt_logprobs=100), "prompt_logprobs must be between 0 and 20"),
    (dict(logprobs=1, beam_width=2), "not supported with beam search"),
    (dict(prompt_logprobs=0, beam_width=3), "not supported with beam search"),
])
async def test_bad_logprob_requests_are_invalid_argument(server, sampling, message):
    async with AsyncFolioClient(server.address, timeout=60) as client:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.generate_text(token_ids=[5, 6, 7], max_tokens=2, **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def hf_processed_log_softmax(hf_model, token_ids: list[int], num_prompt: int,
                            processors) -> torch.Tensor:
    """[len(token_ids) - num_prompt, vocab]: row i is HF's processors applied to the logits of
    output token i, teacher-forced on `token_ids`, then log_softmax."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
        rows = []
        for pos in range(num_prompt - 1, len(token_ids) - 1):
            scores = processors(torch.tensor([token_ids[:pos + 1]]), logits[pos:pos + 1].clone())
            rows.append(torch.log_softmax(scores[0], dim=-1))
    return torch.stack(rows)


async def test_processed_logprobs_equal_hf_processors_and_warpers(server, hf_model):
    """PROCESSED: the distribution each token was drawn from. Greedy with a repetition
    penalty: HF's RepetitionPenaltyLogitsProcessor; sampled with temperature and top-k: HF's
    processor then TemperatureLogitsWarper and TopKLogitsWarper (removed tokens at -inf)."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    prompt = random_prompts(hf_model.config.vocab_size, (21,), seed=17)[0]
    cases = [
        (dict(temperature=0.0, repetition_penalty=1.7),
         LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.7)])),
        (dict(temperature=0.8, top_k=5, seed=11, repetition_penalty=1.3),
         LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8),
                              TopKLogitsWarper(5)])),
    ]
    async with AsyncFolioClient(server.address, timeout=240) as client:
        for sampling, processors in cases:
            c = await client.generate_text(token_ids=prompt, max_tokens=8, ignore_eos=True,
                                           logprobs=3, logprobs_mode="processed", **sampling)
            rows = hf_processed_log_softmax(hf_model, prompt + c.token_ids, len(prompt),
                                            processors)
            for i, entry in enumerate(c.logprobs):
                row, token_id = rows[i], c.token_ids[i]
                assert entry["token_id"] == token_id
                assert abs(entry["logprob"] - float(row[token_id])) < 1e-4
                assert entry["rank"] == int((row > row[token_id]).sum()) + 1
                assert [a["token_id"] for a in entry["top_logprobs"]] == row.topk(3)[1].tolist()
            if sampling["temperature"]:
                # Outside the top 5 the processed distribution is empty: -inf, never drawn.
                assert all(math.isfinite(e["logprob"]) for e in c.logprobs)
                assert all(e["rank"] <= 5 for e in c.logprobs)


async def test_raw_and_processed_rows_in_one_batch_each_get_their_own(server, hf_model):
    """The same seeded request twice, in one batch: the same tokens, one reporting the raw
    distribution and one the processed."""
    prompt = random_prompts(hf_model.config.vocab_size, (30,), seed=19)[0]
    sampling = dict(token_ids=prompt, max_tokens=8, ignore_eos=True, logprobs=2,
                    temperature=1.2, top_p=0.7, seed=5)
    async with AsyncFolioClient(server.address, timeout=240) as client:
        raw, processed = await asyncio.gather(
            client.generate_text(**sampling, logprobs_mode="raw"),
            client.generate_text(**sampling, logprobs_mode="processed"))
    assert raw.token_ids == processed.token_ids
    rows = hf_log_softmax(hf_model, prompt + raw.token_ids)
    for i, (r, p) in enumerate(zip(raw.logprobs, processed.logprobs, strict=True)):
        assert_entry(r, rows[len(prompt) + i - 1], raw.token_ids[i], 2)
        # Temperature keeps the order and the nucleus is a prefix of it: the same rank, a
        # different value.
        assert p["token_id"] == r["token_id"] and p["rank"] == r["rank"]
        assert abs(p["logprob"] - r["logprob"]) > 1e-6


async def test_unknown_logprobs_mode_is_invalid_argument(server):
    req = generate_request(token_ids=[5, 6, 7], max_tokens=2, logprobs=1)
    req.sampling.logprobs_mode = 7
    async with AsyncFolioClient(server.address, timeout=60) as client:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in client._stub.Generate(req):
                pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown logprobs_mode value 7" in e.value.details()


def test_executor_crash_resends_no_logprobs_and_no_prompt_logprobs(folio_server, checkpoint,
                                                                  hf_model):
    """The executor is SIGKILLed while a seeded n = 2 stream runs and a long prompt is in its
    chunked prefill: both resume and report exactly what an unbroken run reports, every token
    once with its logprobs, the prompt's logprobs once."""
    import os
    import signal
    import threading

    from client import FolioClient
    from tests.e2e.engine.test_e2e_faults import executor_pid

    short, long = random_prompts(hf_model.config.vocab_size, (9, 400), seed=12)
    reqs = [dict(token_ids=short, temperature=0.9, seed=3, n=2, max_tokens=60, ignore_eos=True,
                 logprobs=2, prompt_logprobs=2),
            dict(token_ids=long, temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1,
                 prompt_logprobs=1)]

    def run(address: str, kill: bool) -> list[list]:
        messages: list[list] = [[], []]
        started = threading.Event()

        def one(i: int) -> None:
            with FolioClient(address, timeout=300) as client:
                for m in client.generate(**reqs[i]):
                    messages[i].append(m)
                    if i == 0 and sum(len(x.token_ids) for x in messages[0]) >= 10:
                        started.set()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        if kill:
            assert started.wait(120)
            os.kill(executor_pid(server.proc.pid), signal.SIGKILL)
        for t in threads:
            t.join(300)
        return messages

    with folio_server(model=checkpoint, args=BUDGET) as server:
        unbroken = run(server.address, kill=False)
        resumed = run(server.address, kill=True)
        log = server.log_tail(200_000)
    assert "requests resumed" in log
    for want, have, req in zip(unbroken, resumed, reqs, strict=True):
        want_seqs, have_seqs = fold(want), fold(have)
        assert sorted(have_seqs) == sorted(want_seqs)
        for index, (token_ids, entries) in have_seqs.items():
            assert token_ids == want_seqs[index][0]
            assert len(entries) == req["max_tokens"]
            assert_close_entries(entries, want_seqs[index][1])
        carrying = [m for m in have if m.prompt_logprobs]
        assert len(carrying) == 1 and len(carrying[0].prompt_logprobs) == len(req["token_ids"]) - 1
        assert_close_entries(list(map(token_logprobs_dict, carrying[0].prompt_logprobs)),
                             [token_logprobs_dict(t) for m in want for t in m.prompt_logprobs])
