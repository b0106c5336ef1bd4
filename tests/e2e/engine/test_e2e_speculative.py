"""Speculative decoding (n-gram and draft-model proposals) through real processes: `folio serve` (scheduler +
executor child) on tiny random checkpoints, HF transformers as the oracle.

- Greedy output with speculation equals HF's greedy token for token, on every architecture,
  with the prefix cache on and a pool small enough that requests are preempted (by recompute,
  with chunked prefill in steps of 24 tokens, and by swap). Prompts repeat a random phrase,
  so proposals are found and partly accepted: the server took fewer steps than it generated
  tokens.
- Seeded sampling with speculation repeats itself exactly and equals plain decoding; requests
  that may not speculate (logprobs, penalties) run beside speculating ones and still get what
  they asked for; an executor killed mid-run changes no stream (all equal plain decoding).
- Draft models: the served model cut to one layer (every architecture, preemption, the prefix
  cache) and drafting for itself whole (every proposal accepted).
- The acceptance counters: GetServerStats and /metrics report the same proposals verified and
  accepted, and a request alone accounts for its tokens exactly (one per step, plus each
  accepted proposal).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from client import AsyncFolioClient, FolioClient
from tests.conftest import free_port
from tests.e2e.e2e_util import wait_idle
from tests.e2e.hf_oracle import NUM_SPECIAL_TOKENS, hf_greedy, load_hf_model, mismatch_report
from tests.fixtures.checkpoints import ARCHS, make_checkpoint
from tests.fixtures.metrics_scrape import check_against_server_stats, check_labels, scrape

BLOCK_SIZE = 16
MAX_TOKENS = 40
SPEC = ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]


def repetitive_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase a few times (n-gram proposals find it), one of
    them long enough to fill several blocks."""
    rng = random.Random(seed)
    prompts = []
    for phrase_len, repeats in ((3, 4), (5, 3), (8, 5), (2, 9), (6, 12), (4, 2)):
        phrase = [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(phrase_len)]
        prompts.append(phrase * repeats + phrase[:1])
    return prompts


def assert_hf_greedy(hf, prompts, expected, completions) -> None:
    reports = [mismatch_report(hf, p, e, c.token_ids)
               for p, e, c in zip(prompts, expected, completions, strict=True)
               if e != c.token_ids]
    assert not reports, "\n".join(reports)


async def _generate(address: str, prompts, **kwargs):
    async with AsyncFolioClient(address, timeout=120) as client:
        return await asyncio.gather(*(client.generate_text(token_ids=p, max_tokens=MAX_TOKENS,
                                                           ignore_eos=True, **kwargs)
                                      for p in prompts))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_hf_with_speculation(folio_server, tmp_path_factory, arch, mode):
    checkpoint = make_checkpoint(arch, tmp_path_factory.mktemp(f"spec-{arch}"))
    hf = load_hf_model(checkpoint)
    prompts = repetitive_prompts(hf.config.vocab_size)
    expected = hf_greedy(hf, prompts, MAX_TOKENS)
    args = ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "14", "--preemption-mode",
            mode, *SPEC]
    if mode == "swap":
        args += ["--swap-space", "0.002"]
    else:  # chunked prefill: prompts over several steps, proposals trimmed to the budget
        args += ["--max-num-batched-tokens", "24"]
    with folio_server(model=checkpoint, args=args) as server:
        completions = asyncio.run(_generate(server.address, prompts, temperature=0.0))
        before = wait_idle(server.address)
        alone = asyncio.run(_generate(server.address, prompts[4:5], temperature=0.0))
        stats = wait_idle(server.address)
        # Again: its prompt's blocks now come from the prefix cache.
        again = asyncio.run(_generate(server.address, prompts[4:5], temperature=0.0))
        after = wait_idle(server.address)
    assert_hf_greedy(hf, prompts, expected, completions)
    assert again[0].token_ids == expected[4]
    assert after["prefix_cache_hits"] > stats["prefix_cache_hits"]
    assert stats["num_preemptions"] > 0, "the pool was meant to run short"
    assert alone[0].token_ids == expected[4]
    assert stats["num_generated_tokens"] == MAX_TOKENS * (len(prompts) + 1)
    # Alone, a request takes one step per token without speculation (its first token comes
    # with its prompt's last chunk): fewer steps mean accepted proposals.
    steps = stats["num_steps"] - before["num_steps"]
    assert steps < MAX_TOKENS, f"{steps} steps for {MAX_TOKENS} tokens: nothing accepted"


def test_seeded_sampling_repeats_and_others_unaffected(folio_server, tmp_path_factory):
    """With speculation on: a seeded sampled request gives the same tokens every time, alone
    or beside others, and the same as without speculation; greedy requests that may not speculate (logprobs, a penalty) run in the
    same steps and still equal HF's greedy where no penalty applies."""
    checkpoint = make_checkpoint("qwen2", tmp_path_factory.mktemp("spec-seeded"))
    hf = load_hf_model(checkpoint)
    prompts = repetitive_prompts(hf.config.vocab_size, seed=1)
    seeded = dict(temperature=0.8, top_k=50, top_p=0.95, seed=1234)
    with folio_server(model=checkpoint, args=["--block-size", str(BLOCK_SIZE), *SPEC]) as server:
        first = asyncio.run(_generate(server.address, prompts[:1], **seeded))[0]

        async def mixed():
            async with AsyncFolioClient(server.address, timeout=120) as client:
                return await asyncio.gather(
                    client.generate_text(token_ids=prompts[0], max_tokens=MAX_TOKENS,
                                         ignore_eos=True, **seeded),
                    client.generate_text(token_ids=prompts[1], max_tokens=MAX_TOKENS,
                                         ignore_eos=True, temperature=0.0, logprobs=2),
                    client.generate_text(token_ids=prompts[2], max_tokens=MAX_TOKENS,
                                         ignore_eos=True, temperature=0.0,
                                         repetition_penalty=1.3),
                    client.generate_text(token_ids=prompts[3], max_tokens=MAX_TOKENS,
                                         ignore_eos=True, temperature=0.0))

        again, with_logprobs, penalised, plain = asyncio.run(mixed())
        wait_idle(server.address)
    with folio_server(model=checkpoint, args=["--block-size", str(BLOCK_SIZE)]) as server:
        unspeculated = asyncio.run(_generate(server.address, prompts[:1], **seeded))[0]
    assert again.token_ids == first.token_ids and len(first.token_ids) == MAX_TOKENS
    # Every token is the one plain decoding draws at its index (spec/verifier.py).
    assert first.token_ids == unspeculated.token_ids
    expected = hf_greedy(hf, [prompts[1], prompts[3]], MAX_TOKENS)
    assert with_logprobs.token_ids == expected[0] and plain.token_ids == expected[1]
    assert len(with_logprobs.logprobs) == MAX_TOKENS
    assert len(penalised.token_ids) == MAX_TOKENS


DRAFT = ["--speculative-method", "draft", "--num-speculative-tokens", "3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_model_greedy_equals_hf(folio_server, tmp_path_factory, arch):
    """The served model drafting for itself cut to one layer: greedy output equals HF's, under
    preemption and with the prefix cache."""
    checkpoint = make_checkpoint(arch, tmp_path_factory.mktemp(f"draft-{arch}"))
    hf = load_hf_model(checkpoint)
    prompts = repetitive_prompts(hf.config.vocab_size, seed=2)
    expected = hf_greedy(hf, prompts, MAX_TOKENS)
    args = ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "16", *DRAFT,
            "--speculative-draft-layers", "1"]
    with folio_server(model=checkpoint, args=args) as server:
        completions = asyncio.run(_generate(server.address, prompts, temperature=0.0))
        asyncio.run(_generate(server.address, prompts[4:5], temperature=0.0))
        before = wait_idle(server.address)
        again = asyncio.run(_generate(server.address, prompts[4:5], temperature=0.0))
        stats = wait_idle(server.address)
    assert_hf_greedy(hf, prompts, expected, completions)
    assert again[0].token_ids == expected[4]
    assert stats["num_preemptions"] > 0, "the pool was meant to run short"
    assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]


def test_whole_model_drafting_for_itself_is_always_right(folio_server, tmp_path_factory):
    """A draft equal to the target proposes the target's own greedy tokens: every proposal is
    accepted, so a request alone takes about MAX_TOKENS / 4 steps, and the output is HF's."""
    checkpoint = make_checkpoint("qwen3", tmp_path_factory.mktemp("draft-self"))
    hf = load_hf_model(checkpoint)
    prompt = repetitive_prompts(hf.config.vocab_size, seed=3)[4]
    with folio_server(model=checkpoint, args=["--block-size", str(BLOCK_SIZE), *DRAFT]) as server:
        before = wait_idle(server.address)
        alone = asyncio.run(_generate(server.address, [prompt], temperature=0.0))
        stats = wait_idle(server.address)
    assert alone[0].token_ids == hf_greedy(hf, [prompt], MAX_TOKENS)[0]
    steps = stats["num_steps"] - before["num_steps"]
    # One prefill step (no proposals yet: its lookahead comes with the first decode), one
    # plain decode, then 4 tokens a step.
    assert steps <= 2 + -(-(MAX_TOKENS - 2) // 4), f"{steps} steps for {MAX_TOKENS} tokens"


async def test_executor_killed_under_speculation_streams_equal_plain_decoding(
        folio_server, tmp_path_factory):
    """Part of the fault workload of tests/e2e/engine/test_e2e_faults.py (greedy, seeded, penalised,
    n = 4, beam search) through a server with n-gram speculation whose executor is SIGKILLed
    mid-run: every stream equals an undisturbed run of a server without speculation."""
    from tests.e2e.engine import test_e2e_faults as faults

    checkpoint = make_checkpoint("llama3", tmp_path_factory.mktemp("spec-faults"))
    every = faults.workload(load_hf_model(checkpoint).config.vocab_size)
    # A third of it, shorter: 8 greedy, 3 seeded, the penalised, n = 4 and beam requests.
    reqs = every[:8] + every[24:27] + every[32:34] + every[-2:]
    for r in reqs:
        r["max_tokens"] = min(r["max_tokens"], 80)
        if "min_tokens" in r:
            r["min_tokens"] = min(r["min_tokens"], 60)
    with folio_server(model=checkpoint, args=["--num-kv-blocks", "1024"]) as server:
        reference = await faults.run_all(server.address, reqs, "ref", [0])
    with folio_server(model=checkpoint, args=["--num-kv-blocks", "1024", *SPEC]) as server, \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(faults, "NUM_KILLS", 1)
        progress = [0]
        streams = asyncio.ensure_future(faults.run_all(server.address, reqs, "run", progress))
        killer = asyncio.ensure_future(faults.kill_executor_repeatedly(server, progress,
                                                                       len(reqs)))
        done, _ = await asyncio.wait({streams, killer}, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
        await killer
        results = await streams
        log = server.log_tail(200_000)
    assert log.count("executor exited; restarting it") == 1
    assert log.count("requests resumed") >= 1, "the kill came after the streams ended"
    assert sorted(results) == sorted(reference)
    for key, want in reference.items():
        assert results[key]["tokens"] == want["tokens"], f"{key} differs from plain decoding"
        assert results[key]["finish"] == want["finish"], key


def test_acceptance_counters_in_server_stats_and_metrics(folio_server, tmp_path_factory):
    """Proposals verified (draft) and accepted, as GetServerStats and /metrics count them.
    A request alone, its prompt computed in one step, gets one token from that step and
    1 + (proposals accepted) from each later one: its tokens = steps + accepted."""
    checkpoint = make_checkpoint("qwen2", tmp_path_factory.mktemp("spec-counters"))
    vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    prompts = repetitive_prompts(vocab_size, seed=2)
    metrics_port = free_port()
    args = ["--block-size", str(BLOCK_SIZE), "--metrics-port", str(metrics_port), *SPEC]
    with folio_server(model=checkpoint, args=args) as server:
        with FolioClient(server.address, timeout=60) as client:
            model_name = client.model_info()["model_name"]
        off = wait_idle(server.address)
        asyncio.run(_generate(server.address, prompts[:4], temperature=0.0))
        before = wait_idle(server.address)
        alone = asyncio.run(_generate(server.address, prompts[4:5], temperature=0.0))
        stats = wait_idle(server.address)
        samples = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    assert (off["num_draft_tokens"], off["num_accepted_tokens"]) == (0, 0)
    assert before["num_draft_tokens"] > 0 and 0 < before["num_accepted_tokens"] \
        <= before["num_draft_tokens"], before
    drafts, accepted, steps = (stats[k] - before[k] for k in (
        "num_draft_tokens", "num_accepted_tokens", "num_steps"))
    assert len(alone[0].token_ids) == MAX_TOKENS
    assert 0 < accepted <= drafts and steps + accepted == MAX_TOKENS, (drafts, accepted, steps)
    check_labels(samples, model_name)
    check_against_server_stats(samples, stats)  # the spec_decode counters among the others


def test_a_separate_draft_checkpoint(folio_server, tmp_path_factory):
    """--speculative-model: another checkpoint sharing the vocabulary (a one-layer model of
    another architecture) drafts; greedy output is still HF's."""
    checkpoint = make_checkpoint("llama3", tmp_path_factory.mktemp("draft-target"))
    draft = make_checkpoint("qwen2", tmp_path_factory.mktemp("draft-other"), num_hidden_layers=1)
    hf = load_hf_model(checkpoint)
    prompts = repetitive_prompts(hf.config.vocab_size, seed=4)[:3]
    args = ["--block-size", str(BLOCK_SIZE), *DRAFT, "--speculative-model", str(draft)]
    with folio_server(model=checkpoint, args=args) as server:
        completions = asyncio.run(_generate(server.address, prompts, temperature=0.0))
        stats = wait_idle(server.address)
    assert [c.token_ids for c in completions] == hf_greedy(hf, prompts, MAX_TOKENS)
    assert stats["num_draft_tokens"] > 0


def test_prompt_logprobs_beside_ngram_speculation(folio_server):
    """A request asking for prompt logprobs: after its first token the scheduler no longer
    owes them, but the executor's copy of the request still asks for them, so the executor
    refuses proposals for it (SpecVerifier.refusal). The scheduler proposed anyway, and the
    step failed with every request in it. It must decode unspeculated, like plain decoding."""
    phrase = [101, 202, 303, 404, 505]
    prompt = phrase * 6 + phrase[:2]  # n-gram proposals find the phrase at once
    with folio_server(model="folio:tiny-random", args=["--block-size", str(BLOCK_SIZE),
                                                       *SPEC]) as server:
        async def both():
            async with AsyncFolioClient(server.address, timeout=120) as client:
                return await asyncio.gather(
                    client.generate_text(token_ids=prompt, max_tokens=16, ignore_eos=True,
                                         temperature=0.0, prompt_logprobs=1),
                    client.generate_text(token_ids=prompt, max_tokens=16, ignore_eos=True,
                                         temperature=0.0))

        with_prompt_logprobs, plain = asyncio.run(both())
        stats = wait_idle(server.address)
    assert with_prompt_logprobs.finish_reason == "length"
    assert with_prompt_logprobs.token_ids == plain.token_ids
    assert len(with_prompt_logprobs.prompt_logprobs) == len(prompt) - 1
    assert stats["num_accepted_tokens"] > 0  # the plain request did speculate
