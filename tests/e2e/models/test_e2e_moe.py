"""Mixture-of-experts models through the real server equal HF transformers, token for token.

Three tiny random checkpoints (tests/fixtures/checkpoints.py): Mixtral (8 experts, top-2
renormalised), Qwen2-MoE (6 experts, top-2 not renormalised, a gated shared expert) and
Qwen3-MoE (8 experts, top-2 renormalised, one dense layer among the MoE ones via
mlp_only_layers). HF `generate` in fp32 on the CPU is the oracle.

Per family, one server with a 32-token step budget (the long prompts are chunked prefills,
batched with the others' decodes and with sampled requests) and the prefix cache on: greedy is
exact and prompts sharing a prefix hit the cache. Then a 16-block pool with a 16-token step
budget forces preemption by recompute. TP = 2 is in test_e2e_tensor_parallel.py.
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
from tests.e2e.hf_oracle import load_hf_model, random_prompts
from tests.fixtures.checkpoints import MOE_ARCHS, make_checkpoint

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


@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_chunked_batched_prefix_cached_greedy_matches_hf(folio_server, models, arch):
    checkpoint, hf_model = models(arch)
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


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
async def test_preemption_keeps_greedy_exact(folio_server, models, arch):
    checkpoint, hf_model = models(arch)
    prompts = random_prompts(hf_model.config.vocab_size, PRESSURE_LENGTHS, seed=6)
    args = ["--block-size", str(BLOCK_SIZE), "--log-format", "json", *SMALL_POOL,
            "--preemption-mode", "recompute", "--max-num-batched-tokens", "16"]
    with folio_server(model=checkpoint, args=args) as server:
        completions = await generate_all(server.address, prompts, MAX_TOKENS)
        stats = wait_idle(server.address)
        events = preemptions_in_log(server)
    assert_hf_exact(hf_model, prompts, completions, MAX_TOKENS)
    assert stats["num_preemptions"] > 0, stats
    assert events and {e["mode"] for e in events} == {"recompute"}, events
