"""Sliding-window models through the real server equal HF transformers, token for token.

Five tiny random checkpoints whose windows (16..24 tokens) the prompts (up to 131 tokens) and
continuations cross: Mistral (every layer), Qwen2 (layers from max_window_layers on), Gemma 2
(alternating, attention and final softcaps), Gemma 3 (two local layers with their own RoPE
base per global one with a scaled RoPE) and Phi-3 (every layer, LongRoPE). HF `generate` in fp32 on the CPU is the oracle.

Per family, one server with a 32-token step budget (every long prompt is a chunked prefill,
batched with the others' decodes and with sampled requests) and the prefix cache on: greedy
is exact, prompts sharing a prefix hit the cache, n = 2 greedy gives two copies of HF's
greedy, and beam search equals HF's. Four more servers with small pools force preemption: by
swap (Gemma 3; Phi-3, whose 8 blocks hold less than one of its contexts without the window's
releases) and by recompute (Qwen2, Gemma 2).
"""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncFolioClient
from tests.e2e.e2e_util import wait_idle
from tests.e2e.engine.test_e2e_memory import SMALL_POOL
from tests.e2e.hf_oracle import hf_beam_search, hf_greedy, random_prompts
from tests.e2e.models.family_checks import (
    CHUNKED_ARGS,
    MAX_TOKENS,
    check_chunked_batched_prefix_cached,
    check_preemption,
    models,  # noqa: F401 (a fixture)
)
from tests.fixtures.checkpoints import WINDOWED_ARCHS

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", params=WINDOWED_ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(folio_server, models, arch):  # noqa: F811
    with folio_server(model=models(arch)[0], args=CHUNKED_ARGS) as s:
        yield s


async def test_chunked_batched_prefix_cached_greedy_matches_hf(arch, server, models):  # noqa: F811
    await check_chunked_batched_prefix_cached(server.address, models(arch)[1])


async def test_n2_greedy_and_beam_search_match_hf(arch, server, models):  # noqa: F811
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
    # Qwen2's windowed groups release as the 16-token chunks go: 32 blocks, so that
    # preemption still happens.
    pytest.param("qwen2_window", "recompute", ["--preemption-mode", "recompute",
                                               "--max-num-batched-tokens", "16",
                                               "--num-kv-blocks", "32"],
                 id="qwen2_window-recompute"),
    pytest.param("gemma2", "recompute", ["--preemption-mode", "recompute",
                                         "--max-num-batched-tokens", "16",
                                         "--num-kv-blocks", "32"], id="gemma2-recompute"),
    # Phi-3 slides every layer: one group whose sequences hold a window and a chunk each (7
    # blocks of 16 at most), so 8 blocks hold any one of them and not two.
    pytest.param("phi3_window", "swap", ["--preemption-mode", "swap", "--swap-space", "0.002",
                                         "--max-num-batched-tokens", "64",
                                         "--num-kv-blocks", "8"],
                 id="phi3_window-swap"),
])
async def test_preemption_keeps_greedy_exact(folio_server, models, arch, mode, args):  # noqa: F811
    checkpoint, hf_model = models(arch)
    await check_preemption(folio_server, checkpoint, hf_model, mode, [*SMALL_POOL, *args])
