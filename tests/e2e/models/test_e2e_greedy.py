"""Greedy generation through the real server equals HF transformers, token for token.

Per architecture: a tiny random checkpoint, one real `folio serve` (scheduler process +
executor process on 127.0.0.1), prompts of 1..200 tokens sent concurrently over gRPC so they
share batches (chunked prefills next to decodes), and HF `generate(do_sample=False)` in fp32 on
the CPU as the oracle. A second server with a KV pool far too small for all of them at once
must preempt (recompute) and still produce the same tokens.
"""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncFolioClient, FolioClient
from tests.e2e.e2e_util import wait_idle
from tests.e2e.hf_oracle import hf_greedy, load_hf_model, mismatch_report, random_prompts
from tests.fixtures.checkpoints import ARCHS, make_checkpoint

MAX_TOKENS = 32
BLOCK_SIZE = 16
# Preemption must happen whatever order the requests arrive in: a prompt of 113..128 tokens
# takes 8 of the 16 blocks when admitted but needs 10 once it has its 32 tokens,
# so any two of them running together run the pool dry. Every request still fits alone.
SMALL_POOL_BLOCKS = 16
SMALL_POOL_LENGTHS = (1, 17, 40, 113, 116, 120, 124, 128)


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch, tmp_path_factory):
    return make_checkpoint(arch, tmp_path_factory.mktemp(f"ckpt-{arch}"))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def server(folio_server, checkpoint):
    with folio_server(model=checkpoint, args=["--block-size", str(BLOCK_SIZE)]) as s:
        yield s


@pytest.fixture(scope="module")
def small_pool_server(folio_server, checkpoint):
    args = ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(SMALL_POOL_BLOCKS)]
    with folio_server(model=checkpoint, args=args) as s:
        yield s


async def generate_all(address: str, prompts: list[list[int]],
                       num_sampled: int = 0) -> list[list[int]]:
    """All prompts at once, greedy; returns each stream's token ids after checking how it
    ended. `num_sampled` extra requests with random sampling share the batches, so greedy rows
    must come out exact next to sampled ones."""
    async with AsyncFolioClient(address, timeout=240) as client:
        greedy = [client.generate_text(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS,
                                       ignore_eos=True, request_id=f"greedy-{i}")
                  for i, p in enumerate(prompts)]
        sampled = [client.generate_text(token_ids=prompts[i % len(prompts)], temperature=1.0,
                                        top_p=0.9, top_k=50, seed=i, max_tokens=MAX_TOKENS,
                                        ignore_eos=True)
                   for i in range(num_sampled)]
        completions = await asyncio.gather(*greedy, *sampled)
    for c in completions[len(prompts):]:
        assert c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS, c
    completions = completions[:len(prompts)]
    for i, (prompt, c) in enumerate(zip(prompts, completions, strict=True)):
        assert c.request_id == f"greedy-{i}"
        assert c.finish_reason == "length", c
        assert c.usage == {"prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                           "cached_tokens": c.usage["cached_tokens"]}
    return [c.token_ids for c in completions]


def assert_same_tokens(hf_model, prompts, expected, got) -> None:
    reports = [mismatch_report(hf_model, p, e, g)
               for p, e, g in zip(prompts, expected, got, strict=True) if e != g]
    assert not reports, f"{len(reports)}/{len(prompts)} prompts differ from HF:\n" + \
        "\n".join(reports)


async def test_concurrent_greedy_matches_hf(arch, server, hf_model):
    prompts = random_prompts(hf_model.config.vocab_size)
    got = await generate_all(server.address, prompts, num_sampled=3)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    assert all(len(e) == MAX_TOKENS for e in expected)
    assert_same_tokens(hf_model, prompts, expected, got)
    with FolioClient(server.address) as client:
        info = client.model_info()
    assert info["architecture"] == hf_model.config.architectures[0]
    assert info["vocab_size"] == hf_model.config.vocab_size
    stats = wait_idle(server.address)  # every block back once the streams have ended
    assert stats["num_generated_tokens"] >= MAX_TOKENS * (len(prompts) + 3)


async def test_preemption_keeps_greedy_exact(arch, small_pool_server, hf_model):
    prompts = random_prompts(hf_model.config.vocab_size, SMALL_POOL_LENGTHS, seed=1)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    # The pool holds a third of the prompts' tokens, so requests that overlap preempt; on a
    # busy machine the streams can start far enough apart that one round does not, so up to
    # three rounds run, each exact, until one has preempted.
    for _ in range(3):
        got = await generate_all(small_pool_server.address, prompts)
        assert_same_tokens(hf_model, prompts, expected, got)
        stats = wait_idle(small_pool_server.address)
        assert stats["kv_blocks_total"] == SMALL_POOL_BLOCKS
        if stats["num_preemptions"] > 0:
            break
    assert stats["num_preemptions"] > 0, stats
