"""`folio serve --kv-cache-dtype fp8 | int8` on the CPU: the real server over a quantized KV
cache against the same server over its plain one (the oracle: token-exact against HF in
test_e2e_greedy.py).

A quantized cache is lossy, so the continuations are compared by agreement (the mean share of
each one that matches the plain run before the first difference); the pool holds 4x the blocks
with fp8 (the model is fp32) and what int8's scales leave, in the same --kv-cache-memory; both
APIs report the KV dtype; an unknown one stops the server at start with the flag's name.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc

from client import FolioClient
from tests.e2e.hf_oracle import random_prompts
from tests.e2e.models.test_e2e_greedy import MAX_TOKENS, generate_all
from tests.fixtures.checkpoints import make_checkpoint

pytestmark = pytest.mark.timeout(600)

PROMPT_LENGTHS = (1, 7, 16, 17, 40, 64, 131)
MEMORY = "1MiB"
# Mean common-prefix share of 32 greedy tokens against the plain cache, measured on this
# checkpoint: fp8 0.50, int8 1.00 (the random model's K/V rows are small, so e4m3 at scale 1.0
# rounds coarsely). The floors sit below and catch a cache read wrongly (agreement ~0).
AGREEMENT_FLOOR = {"fp8": 0.25, "int8": 0.5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("llama2", tmp_path_factory.mktemp("kv-dtype"))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(300, PROMPT_LENGTHS, seed=11)


@pytest.fixture(scope="module")
def served(folio_server, checkpoint, prompts):
    """Per --kv-cache-dtype: (model info, vLLM server info, greedy continuations)."""
    runs = {}

    async def run(kv_dtype, extra=()):
        args = ["--block-size", "16", "--kv-cache-memory", MEMORY, "--kv-cache-dtype", kv_dtype,
                *extra]
        with folio_server(model=checkpoint, args=args) as server:
            with FolioClient(server.address) as client:
                info = client.model_info()
            with grpc.insecure_channel(server.address) as channel:
                server_info = vpb_grpc.VllmEngineStub(channel).GetServerInfo(
                    vpb.GetServerInfoRequest(), timeout=10)
            return info, server_info, await generate_all(server.address, prompts)

    return run, runs


async def _run(served, kv_dtype):
    run, runs = served
    if kv_dtype not in runs:
        runs[kv_dtype] = await run(kv_dtype)
    return runs[kv_dtype]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
async def test_quantized_cache_agrees_with_the_plain_one(served, kv_dtype):
    plain_info, plain_server, plain = await _run(served, "auto")
    info, server_info, got = await _run(served, kv_dtype)
    assert plain_info["kv_cache_dtype"] == plain_info["dtype"] == "float32"
    assert plain_server.kv_cache_dtype == "float32"
    name = {"fp8": "fp8_e4m3", "int8": "int8"}[kv_dtype]
    assert info["kv_cache_dtype"] == server_info.kv_cache_dtype == name
    assert info["dtype"] == server_info.model_dtype == "float32"
    # The same memory: 4 bytes an element in fp32, 1 in fp8, 1 + 4 / head_dim in int8
    # (head_dim 16 here: its scale per head row is 20% more).
    head_dim = 16
    expected = 4 * plain_info["num_kv_blocks"] if kv_dtype == "fp8" else int(
        plain_info["num_kv_blocks"] * 4 * head_dim / (head_dim + 4))
    assert abs(info["num_kv_blocks"] - expected) <= 1, (info["num_kv_blocks"], expected)
    assert all(len(g) == MAX_TOKENS for g in got)
    agreement = sum(_common_prefix(p, g) for p, g in zip(plain, got, strict=True)) / (
        MAX_TOKENS * len(plain))
    print(f"--kv-cache-dtype {kv_dtype}: greedy agreement with the plain cache {agreement:.3f}")
    assert agreement >= AGREEMENT_FLOOR[kv_dtype], agreement


async def test_draft_speculation_over_an_int8_cache_changes_no_token(served):
    """The draft model (the served one cut to one layer) gets a cache of the KV dtype too;
    verification keeps the target's greedy tokens: those of the int8 run without it."""
    run, _ = served
    _, _, plain = await _run(served, "int8")
    _, _, speculated = await run("int8", ["--speculative-method", "draft",
                                          "--num-speculative-tokens", "3",
                                          "--speculative-draft-layers", "1"])
    assert speculated == plain


def test_unknown_kv_cache_dtype_stops_the_server_at_start(checkpoint):
    done = subprocess.run([sys.executable, "-m", "client.cli", "serve", "--model",
                           str(checkpoint), "--kv-cache-dtype", "fp8_e5m2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, int8" in done.stderr
