"""Mixture-of-experts models through the real server equal HF transformers, token for token.

Five tiny random checkpoints (tests/fixtures/checkpoints.py): Mixtral (8 experts, top-2
renormalised), Qwen2-MoE (6 experts, top-2 not renormalised, a gated shared expert),
Qwen3-MoE (8 experts, top-2 renormalised, one dense layer among the MoE ones via
mlp_only_layers) and gpt-oss (4 experts, top-2, biased experts with the clamped SwiGLU,
attention sinks, layers alternating a 16-token window and full attention in two KV groups,
YaRN over an original context of 64 that the prompts and continuations cross), and that
gpt-oss with its experts as MXFP4 blocks and scales (as openai ships it), which the executor
dequantizes at load. HF `generate` in fp32 on the CPU is the oracle (for MXFP4, HF's own
Mxfp4Config(dequantize=True) load of the same files).

Per family, one server with a 32-token step budget (the long prompts are chunked prefills,
batched with the others' decodes and with sampled requests) and the prefix cache on: greedy is
exact and prompts sharing a prefix hit the cache (tests/e2e/models/family_checks.py). Then
small pools force preemption, by recompute and (gpt-oss) by swap. TP = 2 through the server
is in test_e2e_tensor_parallel.py (slow).
"""

from __future__ import annotations

import pytest

from tests.e2e.engine.test_e2e_memory import SMALL_POOL
from tests.e2e.models.family_checks import (
    CHUNKED_ARGS,
    check_chunked_batched_prefix_cached,
    check_preemption,
    models,  # noqa: F401 (a fixture)
)
from tests.fixtures.checkpoints import MOE_ARCHS

pytestmark = pytest.mark.timeout(600)

RECOMPUTE = ["--preemption-mode", "recompute", "--max-num-batched-tokens", "16"]


@pytest.mark.parametrize("arch", [*MOE_ARCHS, "gpt_oss", "gpt_oss_mxfp4"])
async def test_chunked_batched_prefix_cached_greedy_matches_hf(folio_server, models,  # noqa: F811
                                                               arch):
    checkpoint, hf_model = models(arch)
    with folio_server(model=checkpoint, args=CHUNKED_ARGS) as server:
        await check_chunked_batched_prefix_cached(server.address, hf_model)


@pytest.mark.parametrize("arch, mode, args", [
    pytest.param("qwen2_moe", "recompute", [*SMALL_POOL, *RECOMPUTE], id="qwen2_moe-recompute"),
    pytest.param("qwen3_moe", "recompute", [*SMALL_POOL, *RECOMPUTE], id="qwen3_moe-recompute"),
    # gpt-oss's four layers are two KV groups of two layers (executor_svc/kv/groups.py): 32
    # two-layer blocks are the memory of 16 blocks of every layer, too few for all the prompts
    # at once (their full-attention group alone needs 66) and enough for the longest alone.
    pytest.param("gpt_oss", "recompute", ["--num-kv-blocks", "32", *RECOMPUTE],
                 id="gpt_oss-recompute"),
    pytest.param("gpt_oss", "swap", ["--num-kv-blocks", "32", "--preemption-mode", "swap",
                                     "--swap-space", "0.002", "--max-num-batched-tokens", "64"],
                 id="gpt_oss-swap"),
])
async def test_preemption_keeps_greedy_exact(folio_server, models, arch, mode, args):  # noqa: F811
    checkpoint, hf_model = models(arch)
    await check_preemption(folio_server, checkpoint, hf_model, mode, args)
