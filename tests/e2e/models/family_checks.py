"""What every newer family is checked for through the real server, written once: greedy equal
to HF with chunked prefill in a 32-token budget, batched with sampled requests, and prefix-cache
hits; and greedy kept exact through preemption. Used by test_e2e_windowed.py and
test_e2e_moe.py."""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncFolioClient
from tests.e2e.e2e_util import wait_idle
from tests.e2e.engine.test_e2e_memory import (
    PRESSURE_LENGTHS,
    assert_hf_exact,
    generate_all,
    preemptions_in_log,
    shared_prefix_prompts,
)
from tests.e2e.hf_oracle import load_hf_model, random_prompts
from tests.fixtures.checkpoints import make_checkpoint

BLOCK_SIZE = 16
MAX_TOKENS = 24
PRESSURE_TOKENS = 96
LENGTHS = (1, 17, 40, 113, 131)
CHUNKED_ARGS = ["--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (checkpoint, HF model), built once per module."""
    built = {}

    def get(arch: str):
        if arch not in built:
            ckpt = make_checkpoint(arch, tmp_path_factory.mktemp(f"ckpt-{arch}"))
            built[arch] = (ckpt, load_hf_model(ckpt))
        return built[arch]

    return get


async def check_chunked_batched_prefix_cached(address: str, hf_model) -> None:
    """Prompts of 1..131 tokens and four sharing a 70-token prefix (after one of them has
    cached it), greedy next to two sampled requests: greedy equals HF, the shared prompts hit
    the cache, the sampled ones run to their length."""
    vocab = hf_model.config.vocab_size
    system, shared = shared_prefix_prompts(vocab, seed=3)  # 70 shared tokens: 4 full blocks
    prompts = random_prompts(vocab, LENGTHS, seed=1) + shared
    first = await generate_all(address, shared[:1], MAX_TOKENS)  # caches the shared prefix
    async with AsyncFolioClient(address, timeout=240) as client:
        greedy = [client.generate_text(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS,
                                       ignore_eos=True) for p in prompts[:-len(shared)]]
        cached = [client.generate_text(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS,
                                       ignore_eos=True) for p in shared[1:]]
        sampled = [client.generate_text(token_ids=p, temperature=1.0, top_p=0.9, seed=i,
                                        max_tokens=MAX_TOKENS, ignore_eos=True)
                   for i, p in enumerate(prompts[3:5])]
        done = await asyncio.gather(*greedy, *cached, *sampled)
    num_greedy = len(greedy)
    completions = done[:num_greedy] + first + done[num_greedy:num_greedy + len(cached)]
    assert_hf_exact(hf_model, prompts, completions, MAX_TOKENS)
    assert all(c.usage["cached_tokens"] >= len(system) // BLOCK_SIZE * BLOCK_SIZE
               for c in done[num_greedy:num_greedy + len(cached)]), [c.usage for c in done]
    assert all(len(c.token_ids) == MAX_TOKENS for c in done[-len(sampled):])
    wait_idle(address)


async def check_preemption(folio_server, checkpoint, hf_model, mode: str,
                           args: list[str]) -> None:
    """Prompts that cannot all run at once in the pool `args` give: preemption by `mode`
    happens (and only by it), and greedy stays equal to HF.

    Each request generates PRESSURE_TOKENS, so it lives for ~100 steps: however spread out
    the streams' arrivals are on a loaded machine, all of them are running together for
    long enough that their growth, not the order they came in, decides that someone is
    preempted."""
    prompts = random_prompts(hf_model.config.vocab_size, PRESSURE_LENGTHS, seed=6)
    server_args = ["--block-size", str(BLOCK_SIZE), "--log-format", "json", *args]
    with folio_server(model=checkpoint, args=server_args) as server:
        completions = await generate_all(server.address, prompts, PRESSURE_TOKENS)
        stats = wait_idle(server.address)
        events = preemptions_in_log(server)
    assert_hf_exact(hf_model, prompts, completions, PRESSURE_TOKENS)
    assert stats["num_preemptions"] > 0, stats
    assert events and {e["mode"] for e in events} == {mode}, events
    if mode == "swap":
        assert stats["num_swap_outs"] == stats["num_preemptions"], stats
