"""The scheduler's memory features through real processes, with HF transformers as the oracle.

Each server is a real `folio serve` (scheduler process + executor child) on a tiny random
checkpoint. Greedy outputs must equal HF `generate(do_sample=False)` token for token:
- with and without prefix caching, and across chunk budgets from 8 tokens to 2048;
- under forced preemption by recompute, and by swap to the executor's CPU pool;
- when a shared system prompt is computed once and reused (usage.cached_tokens and the
  scheduler's prompt-token counter say so), and after cached blocks were evicted: a re-sent
  prompt reuses only the blocks that survived, and never reads an evicted one.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from client import AsyncFolioClient, FolioClient
from tests.e2e.e2e_util import wait_idle
from tests.e2e.hf_oracle import (
    NUM_SPECIAL_TOKENS,
    hf_greedy,
    load_hf_model,
    mismatch_report,
    random_prompts,
)
from tests.fixtures.checkpoints import make_checkpoint

ARCH = "llama3"
BLOCK_SIZE = 16
MAX_TOKENS = 24
# Long prompts in a 16-block pool: any two of them running together run it dry (see
# test_e2e_greedy), so preemption happens whatever order the requests arrive in.
SMALL_POOL = ["--num-kv-blocks", "16"]
PRESSURE_LENGTHS = (1, 17, 40, 113, 120, 128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(ARCH, tmp_path_factory.mktemp(f"ckpt-{ARCH}"))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def vocab_size(hf_model) -> int:
    return hf_model.config.vocab_size


def serve(folio_server, checkpoint, *args: str):
    return folio_server(model=checkpoint, args=["--block-size", str(BLOCK_SIZE),
                                                "--log-format", "json", *args])


async def generate_all(address: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    """All prompts at once, greedy; every stream must end by length."""
    async with AsyncFolioClient(address, timeout=120) as client:
        completions = await asyncio.gather(*(
            client.generate_text(token_ids=p, temperature=0.0, max_tokens=max_tokens,
                                 ignore_eos=True) for p in prompts))
    for c in completions:
        assert c.finish_reason == "length" and len(c.token_ids) == max_tokens, c
    return completions


def assert_hf_exact(hf_model, prompts, completions, max_tokens: int = MAX_TOKENS) -> None:
    expected = hf_greedy(hf_model, prompts, max_tokens)
    reports = [mismatch_report(hf_model, p, e, c.token_ids)
               for p, e, c in zip(prompts, expected, completions, strict=True)
               if e != c.token_ids]
    assert not reports, f"{len(reports)}/{len(prompts)} prompts differ from HF:\n" + \
        "\n".join(reports)


def preemptions_in_log(server) -> list[dict]:
    events = []
    for line in server.log_path.read_text(errors="replace").splitlines():
        if '"request preempted"' in line:
            events.append(json.loads(line))
    return events


def shared_prefix_prompts(vocab_size: int, seed: int, num: int = 4, system_len: int = 70):
    rng = random.Random(seed)
    system = [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(system_len)]
    questions = [[rng.randrange(NUM_SPECIAL_TOKENS, vocab_size)
                  for _ in range(rng.randint(8, 20))] for _ in range(num)]
    return system, [system + q for q in questions]


@pytest.mark.parametrize("args", [
    pytest.param(["--no-prefix-caching", "--max-num-batched-tokens", "32"], id="no-cache-32"),
    pytest.param(["--max-num-batched-tokens", "2048"], id="cache-2048"),
])
async def test_greedy_equals_hf_with_and_without_prefix_caching(folio_server, checkpoint,
                                                                hf_model, vocab_size, args):
    _, shared = shared_prefix_prompts(vocab_size, seed=3)
    prompts = shared + random_prompts(vocab_size, (1, 16, 33, 100), seed=4)
    with serve(folio_server, checkpoint, *args) as server:
        first = await generate_all(server.address, prompts[:1])  # caches the system prompt
        rest = await generate_all(server.address, prompts[1:])
        stats = wait_idle(server.address)
    assert_hf_exact(hf_model, prompts, first + rest)
    caching = "--no-prefix-caching" not in args
    cached = [c.usage["cached_tokens"] for c in rest[:len(shared) - 1]]
    assert cached == ([64] * len(cached) if caching else [0] * len(cached))
    assert stats["prefix_cache_hits"] == (sum(cached) if caching else 0)
    assert stats["num_prompt_tokens"] == sum(map(len, prompts)) - sum(cached)


async def test_a_shared_system_prompt_is_computed_once(folio_server, checkpoint, hf_model,
                                                       vocab_size):
    system, prompts = shared_prefix_prompts(vocab_size, seed=5, num=5, system_len=100)
    num_shared = len(system) // BLOCK_SIZE * BLOCK_SIZE  # 96: six full blocks
    with serve(folio_server, checkpoint) as server:
        first = await generate_all(server.address, prompts[:1])
        before = wait_idle(server.address)
        rest = await generate_all(server.address, prompts[1:])
        after = wait_idle(server.address)
    assert first[0].usage["cached_tokens"] == 0
    assert [c.usage["cached_tokens"] for c in rest] == [num_shared] * len(rest)
    # The scheduler computed only what was not cached: the system prompt once in all.
    assert after["num_prompt_tokens"] - before["num_prompt_tokens"] == \
        sum(len(p) - num_shared for p in prompts[1:])
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == num_shared * len(rest)
    assert 0 < after["prefix_cache_hit_rate"] < 1
    assert_hf_exact(hf_model, prompts, first + rest)


@pytest.mark.parametrize("mode, args", [
    pytest.param("recompute", ["--preemption-mode", "recompute",
                               "--max-num-batched-tokens", "8"], id="recompute-budget-8"),
    pytest.param("swap", ["--preemption-mode", "swap", "--swap-space", "0.002",
                          "--max-num-batched-tokens", "64"], id="swap-budget-64"),
])
async def test_forced_preemption_keeps_greedy_exact(folio_server, checkpoint, hf_model,
                                                    vocab_size, mode, args):
    prompts = random_prompts(vocab_size, PRESSURE_LENGTHS, seed=6)
    with serve(folio_server, checkpoint, *SMALL_POOL, *args) as server:
        completions = await generate_all(server.address, prompts)
        stats = wait_idle(server.address)
        events = preemptions_in_log(server)
    assert_hf_exact(hf_model, prompts, completions)
    assert stats["num_preemptions"] > 0, stats
    assert events and {e["mode"] for e in events} == {mode}, events
    swap_outs = stats["num_swap_outs"]
    assert (swap_outs == stats["num_preemptions"]) if mode == "swap" else swap_outs == 0, stats
    if mode == "swap":
        assert stats["swap_blocks_total"] > 0
    # Nothing left behind: every GPU and CPU block is free again.
    assert stats["swap_blocks_free"] == stats["swap_blocks_total"]
    assert stats["num_swapped"] == 0


async def test_an_evicted_block_is_never_read(folio_server, checkpoint, hf_model, vocab_size):
    # 16 blocks of 16. `first` (100 prompt + 4 generated tokens, 103 computed) leaves six full
    # blocks cached and 10 blocks free. `filler` (180 + 4: 12 blocks) takes the 10 free ones
    # and evicts two cached blocks, least recently used first: first's tail (freed first).
    first, filler = random_prompts(vocab_size, (100, 180), seed=7)
    with serve(folio_server, checkpoint, *SMALL_POOL) as server:
        with FolioClient(server.address, timeout=60) as client:
            kw = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
            original = client.generate_text(token_ids=first, **kw)
            client.generate_text(token_ids=filler, **kw)
            again = client.generate_text(token_ids=first, **kw)
        stats = wait_idle(server.address)
    assert original.usage["cached_tokens"] == 0
    assert again.usage["cached_tokens"] == 4 * BLOCK_SIZE  # only the 4 surviving blocks
    assert stats["prefix_cache_hits"] == 4 * BLOCK_SIZE
    expected = hf_greedy(hf_model, [first], 4)[0]
    assert original.token_ids == expected
    assert again.token_ids == expected, mismatch_report(hf_model, first, expected,
                                                        again.token_ids)
