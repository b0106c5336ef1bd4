"""Parallel sampling (n > 1) through the real server: one prompt, n sequences on shared blocks.

One `folio serve` on a tiny llama checkpoint. The KV pool is observed through GetServerStats
while n = 8 sequences decode from a long prompt: the prompt's full blocks are held once, so
the pool use stays near prompt blocks + 8 x decode blocks, far below 8 x everything.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from client import AsyncFolioClient
from tests.e2e.e2e_util import wait_idle
from tests.e2e.hf_oracle import hf_greedy, load_hf_model, random_prompts
from tests.fixtures.checkpoints import make_checkpoint

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 256
LONG_PROMPT = 200  # 12 full blocks + 8 tokens
N = 8
MAX_TOKENS = 64

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("llama2", tmp_path_factory.mktemp("ckpt-parallel"))


@pytest.fixture(scope="module")
def server(folio_server, checkpoint):
    args = ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS)]
    with folio_server(model=checkpoint, args=args) as s:
        yield s


async def stream_by_index(client: AsyncFolioClient, **kwargs) -> dict[int, list]:
    """Every GenerateResponse of one request, grouped by sequence index, in arrival order."""
    by_index: dict[int, list] = defaultdict(list)
    async for resp in client.generate(**kwargs):
        by_index[resp.index].append(resp)
    return dict(by_index)


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_n8_shares_the_prompt_blocks_and_each_sequence_streams(server):
    prompt = random_prompts(1000, (LONG_PROMPT,), seed=3)[0]
    async with AsyncFolioClient(server.address, timeout=120) as client:
        peak_used = 0

        async def watch() -> None:
            nonlocal peak_used
            while True:
                stats = await client.stats()
                peak_used = max(peak_used, stats["kv_blocks_total"] - stats["kv_blocks_free"])
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            by_index = await stream_by_index(
                client, token_ids=prompt, n=N, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                ignore_eos=True)
        finally:
            watcher.cancel()
    assert sorted(by_index) == list(range(N))
    for index, responses in by_index.items():
        assert len(responses) > 1, f"sequence {index} did not stream"
        assert all(r.finish_reason == 0 for r in responses[:-1])
        last = responses[-1]
        assert last.finish_reason == 2  # LENGTH
        assert len(tokens(responses)) == MAX_TOKENS
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == \
            (LONG_PROMPT, MAX_TOKENS)
    assert len({tuple(tokens(r)) for r in by_index.values()}) == N, "sequences should differ"
    full_prompt_blocks = LONG_PROMPT // BLOCK_SIZE
    blocks_per_sequence = -(-(LONG_PROMPT + MAX_TOKENS) // BLOCK_SIZE)
    shared_bound = full_prompt_blocks + N * (blocks_per_sequence - full_prompt_blocks)
    assert full_prompt_blocks < peak_used <= shared_bound, (peak_used, shared_bound)
    assert peak_used < N * full_prompt_blocks  # unshared prompts alone would need this many
    wait_idle(server.address)


async def test_seeded_n_is_reproducible_and_index_0_equals_n_1(server):
    prompt = random_prompts(1000, (37,), seed=4)[0]
    kwargs = dict(token_ids=prompt, temperature=1.0, top_p=0.95, seed=1234, max_tokens=16,
                  ignore_eos=True)
    async with AsyncFolioClient(server.address, timeout=120) as client:
        first, second, single = await asyncio.gather(
            stream_by_index(client, n=4, **kwargs), stream_by_index(client, n=4, **kwargs),
            stream_by_index(client, **kwargs))
    assert {i: tokens(r) for i, r in first.items()} == {i: tokens(r) for i, r in second.items()}
    assert tokens(first[0]) == tokens(single[0])
    assert len({tuple(tokens(r)) for r in first.values()}) > 1


async def test_greedy_n2_gives_two_copies_of_hf_greedy(server, checkpoint):
    prompts = random_prompts(1000, (5, 33), seed=5)
    async with AsyncFolioClient(server.address, timeout=120) as client:
        results = await asyncio.gather(*[
            stream_by_index(client, token_ids=p, n=2, temperature=0.0, max_tokens=12,
                            ignore_eos=True) for p in prompts])
    expected = hf_greedy(load_hf_model(checkpoint), prompts, 12)
    for by_index, want in zip(results, expected, strict=True):
        assert tokens(by_index[0]) == tokens(by_index[1]) == want


async def test_abort_ends_every_sequence_and_frees_all_blocks(server):
    prompt = random_prompts(1000, (20,), seed=6)[0]
    async with AsyncFolioClient(server.address, timeout=120) as client:
        # ~490 steps to go when the first token arrives: the abort lands mid-generation
        # (the tiny model is fast enough that a few dozen tokens could all be done already).
        call = client.generate(token_ids=prompt, n=4, temperature=1.0, ignore_eos=True,
                               request_id="par-abort")
        finals: dict[int, int] = {}
        num_seen = 0
        async for resp in call:
            num_seen += 1
            if num_seen == 1:
                found = await client.abort("par-abort")
                assert found, await client.stats()
            if resp.finish_reason:
                finals[resp.index] = resp.finish_reason
    assert finals == dict.fromkeys(range(4), 3)  # every sequence ends with ABORT
    wait_idle(server.address)


@pytest.mark.parametrize("fields, message", [
    (dict(n=0), "n must be between 1"),
    (dict(n=3, beam_width=2), "n = 3 > beam_width = 2"),
    (dict(beam_width=32, max_tokens=400), "lower beam_width or max_tokens"),
])
async def test_bad_sequence_parameters_are_invalid_argument(server, fields, message):
    import grpc

    async with AsyncFolioClient(server.address, timeout=30) as client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stream_by_index(client, token_ids=[5, 6, 7], **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
