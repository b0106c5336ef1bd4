"""Sliding-window models through the real server equal HF transformers, token for token.

Four tiny random checkpoints whose windows (16..24 tokens) the prompts (up to 131 tokens) and
continuations cross: Mistral (every layer), Qwen2 (layers from max_window_layers on), Gemma 2
(alternating, attention and final softcaps) and Gemma 3 (two local layers with their own RoPE
base per global one with a scaled RoPE). HF `generate` in fp32 on the CPU is the oracle.

Per family, one server with a 32-token step budget (every long prompt is a chunked prefill,
batched with the others' decodes and with sampled requests) and the prefix cache on: greedy
is exact, prompts sharing a prefix hit the cache, n = 2 greedy gives two copies of HF's
greedy, and beam search equals HF's. Two more servers with a 16-block pool force preemption,
one by swap (Gemma 3), one by recompute (Qwen2).
"""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncFolioClient
from tests.e2e.e2e_util import wait_idle
from tests.e2e.engine.test_e2e_memory import (
    PRESSURE_LENGTHS,
    SMALL_POOL,
    assert_hf_exact,
    generate_all,
    preemptions_in_log,
    shared_prefix_prompts,
)
from tests.e2e.hf_oracle import hf_beam_search, hf_greedy, load_hf_model, random_prompts
from tests.fixtures.checkpoints import WINDOWED_ARCHS, make_checkpoint

BLOCK_SIZE = 16
MAX_TOKENS = 24
LENGTHS = (1, 17, 40, 113, 131)

pytestmark = pytest.mark.timeout(600)


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


@pytest.fixture(scope="module", params=WINDOWED_ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(folio_server, models, arch):
    args = ["--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "32"]
    with folio_server(model=models(arch)[0], args=args) as s:
        yield s


async def test_chunked_batched_prefix_cached_greedy_matches_hf(arch, server, models):
    _, hf_model = models(arch)
    vocab = hf_model.config.vocab_size
    system, shared = shared_prefix_prompts(vocab, seed=3)  # 70 shared tokens: 4 full blocks
    prompts = random_prompts(vocab, LENGTHS, seed=1) + shared
    first = await generate_all(server.address, shared[:1])  # caches the shared prefix
    async with AsyncFolioClient(server.address, timeout=240) as client:
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
    wait_idle(server.address)


async def test_n2_greedy_and_beam_search_match_hf(arch, server, models):
    _, hf_model = models(arch)
    long, short = random_prompts(hf_model.config.vocab_size, (60, 9), seed=5)
    beam_width, n, max_tokens = 3, 2, 12
    async with AsyncFolioClient(server.address, timeout=240) as client:
        copies, beams = await asyncio.gather(
            client.generate_choices(token_ids=long, n=2, temperature=0.0,
                                    max_tokens=MAX_TOKENS, ignore_eos=True),
            client.generate_choices(token_ids=long, beam_width=beam_width, n=n,
                                    max_tokens=max_tokens, ignore_eos=True))
        short_beams = await client.generate_choices(token_ids=short, beam_width=beam_width,
                                                    n=n, max_tokens=max_tokens,
                                                    ignore_eos=True)
    want = hf_greedy(hf_model, [long], MAX_TOKENS)[0]
    assert [c.token_ids for c in copies] == [want, want]
    for prompt, got in ((long, beams), (short, short_beams)):
        expected, _, _ = hf_beam_search(hf_model, prompt, beam_width, n, 1.0, False, (),
                                        max_tokens)
        assert [c.token_ids for c in got] == expected, (len(prompt), expected)
    wait_idle(server.address)


@pytest.mark.parametrize("arch, mode, args", [
    # Both models' three layers are three KV groups of one layer (executor_svc/kv/groups.py):
    # 48 one-layer blocks are the memory SMALL_POOL's 16 blocks of every layer would be.
    pytest.param("gemma3", "swap", ["--preemption-mode", "swap", "--swap-space", "0.002",
                                    "--max-num-batched-tokens", "64", "--num-kv-blocks", "48"],
                 id="gemma3-swap"),
    pytest.param("qwen2_window", "recompute", ["--preemption-mode", "recompute",
                                               "--max-num-batched-tokens", "16",
                                               "--num-kv-blocks", "48"],
                 id="qwen2_window-recompute"),
])
async def test_preemption_keeps_greedy_exact(folio_server, models, arch, mode, args):
    checkpoint, hf_model = models(arch)
    prompts = random_prompts(hf_model.config.vocab_size, PRESSURE_LENGTHS, seed=6)
    server_args = ["--block-size", str(BLOCK_SIZE), "--log-format", "json", *SMALL_POOL,
                   *args]
    with folio_server(model=checkpoint, args=server_args) as server:
        completions = await generate_all(server.address, prompts, MAX_TOKENS)
        stats = wait_idle(server.address)
        events = preemptions_in_log(server)
    assert_hf_exact(hf_model, prompts, completions, MAX_TOKENS)
    assert stats["num_preemptions"] > 0, stats
    assert events and {e["mode"] for e in events} == {mode}, events
    if mode == "swap":
        assert stats["num_swap_outs"] == stats["num_preemptions"], stats
