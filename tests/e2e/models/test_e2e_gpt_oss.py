"""gpt-oss through the real server equals HF transformers, token for token.

A tiny random checkpoint (tests/fixtures/checkpoints.py): 4 experts, top-2, biased experts with
the clamped SwiGLU, attention sinks, layers alternating a 16-token window and full attention
(two KV groups), YaRN over an original context of 64 that the prompts (up to 131 tokens) and
continuations cross. HF `generate` in fp32 on the CPU is the oracle.

One server with a 32-token step budget (the long prompts are chunked prefills, batched with
the others' decodes and with sampled requests) and the prefix cache on: greedy is exact and
prompts sharing a prefix hit the cache. Then a small pool with a 16-token step budget forces
preemption by recompute, and another preemption by swap.
"""

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
LENGTHS = (1, 17, 40, 113, 131)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint, HF model), built once per module."""
    ckpt = make_checkpoint("gpt_oss", tmp_path_factory.mktemp("ckpt-gpt_oss"))
    return ckpt, load_hf_model(ckpt)


async def test_chunked_batched_prefix_cached_greedy_matches_hf(folio_server, model):
    checkpoint, hf_model = model
    vocab = hf_model.config.vocab_size
    system, shared = shared_prefix_prompts(vocab, seed=3)  # 70 shared tokens: 4 full blocks
    prompts = random_prompts(vocab, LENGTHS, seed=1) + shared
    args = ["--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "32"]
    with folio_server(model=checkpoint, args=args) as server:
        first = await generate_all(server.address, shared[:1], MAX_TOKENS)  # caches the prefix
        async with AsyncFolioClient(server.address, timeout=240) as client:
            greedy = [client.generate_text(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS,
                                           ignore_eos=True) for p in prompts[:-len(shared)]]
            cached = [client.generate_text(token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS,
                                           ignore_eos=True) for p in shared[1:]]
            sampled = [client.generate_text(token_ids=p, temperature=1.0, top_p=0.9, seed=i,
                                            max_tokens=MAX_TOKENS, ignore_eos=True)
                       for i, p in enumerate(prompts[3:5])]
            done = await asyncio.gather(*greedy, *cached, *sampled)
        wait_idle(server.address)
    num_greedy = len(greedy)
    completions = done[:num_greedy] + first + done[num_greedy:num_greedy + len(cached)]
    assert_hf_exact(hf_model, prompts, completions, MAX_TOKENS)
    assert all(c.usage["cached_tokens"] >= len(system) // BLOCK_SIZE * BLOCK_SIZE
               for c in done[num_greedy:num_greedy + len(cached)]), [c.usage for c in done]
    assert all(len(c.token_ids) == MAX_TOKENS for c in done[-len(sampled):])


# The four layers are two KV groups of two layers (executor_svc/kv/groups.py): 32 two-layer
# blocks are the memory of 16 blocks of every layer, too few for all the prompts at once (their
# full-attention group alone needs 37) and enough for the longest alone (10 + 3).
@pytest.mark.parametrize("mode, args", [
    pytest.param("recompute", ["--preemption-mode", "recompute",
                               "--max-num-batched-tokens", "16"], id="recompute"),
    pytest.param("swap", ["--preemption-mode", "swap", "--swap-space", "0.002",
                          "--max-num-batched-tokens", "64"], id="swap"),
])
async def test_preemption_keeps_greedy_exact(folio_server, model, mode, args):
    checkpoint, hf_model = model
    prompts = random_prompts(hf_model.config.vocab_size, PRESSURE_LENGTHS, seed=6)
    server_args = ["--block-size", str(BLOCK_SIZE), "--log-format", "json",
                   "--num-kv-blocks", "32", *args]
    with folio_server(model=checkpoint, args=server_args) as server:
        completions = await generate_all(server.address, prompts, MAX_TOKENS)
        stats = wait_idle(server.address)
        events = preemptions_in_log(server)
    assert_hf_exact(hf_model, prompts, completions, MAX_TOKENS)
    assert stats["num_preemptions"] > 0, stats
    assert events and {e["mode"] for e in events} == {mode}, events
