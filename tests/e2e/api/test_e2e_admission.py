"""Admission is total (issue 27), through the real processes: one `folio serve --model
folio:tiny-random` on a small KV pool (8 blocks of 16 tokens, so max_model_len is the pool's
128; a CPU swap pool; a 32-token step budget), and hypothesis drawing a handful of batches of
concurrent requests (tests.scheduler.admission_draws: n, beam width, prompt lengths up to and
past max_model_len over shared prefixes, min_tokens, max_tokens, stops, client aborts).

Every request must end each of its sequences with a finish reason and a usage that adds up, or
be refused with INVALID_ARGUMENT exactly when a documented limit says so; greedy parallel
sequences must agree; and after each batch the server must be idle with every block free. The
weights are random, so the null model's token oracle does not apply: the token-exact checks of
the same draws run against the null-model executor (tests/scheduler/test_admission_properties).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from client import FolioClient
from protos.folio.v1 import generator_pb2 as pb
from protos.folio.v1 import generator_pb2_grpc as pb_grpc
from scheduler_svc.text.tokenizer import Tokenizer
from tests.e2e.e2e_util import wait_idle
from tests.scheduler.admission_draws import (
    Drawn,
    Refused,
    Server,
    check_outcome,
    endings_of,
    request_batches,
    response_messages,
)
from tests.scheduler.null_executor import make_hello

NUM_KV_BLOCKS, BLOCK_SIZE = 8, 16
ARGS = ["--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE),
        "--swap-space", "0.001", "--max-num-batched-tokens", "32", "--max-num-seqs", "6",
        "--log-format", "json"]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(folio_server):
    with folio_server(model="folio:tiny-random", args=ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def shape(server, default_model_dir) -> tuple[Server, frozenset[int], int]:
    """The served shape as admission_draws.Server, the model's EOS ids, its vocabulary."""
    with FolioClient(server.address, timeout=30) as client:
        info = client.model_info()
    assert info["num_kv_blocks"] == NUM_KV_BLOCKS and info["block_size"] == BLOCK_SIZE
    assert info["max_model_len"] == NUM_KV_BLOCKS * BLOCK_SIZE  # the pool caps the model's
    with FolioClient(server.address, timeout=30) as client:
        assert client.stats()["swap_blocks_total"] > 0
    hello = make_hello(max_model_len=info["max_model_len"], block_size=BLOCK_SIZE,
                       num_kv_blocks=NUM_KV_BLOCKS)
    return (Server({"enable_prefix_caching": True}, hello),
            Tokenizer(default_model_dir).eos_token_ids, info["vocab_size"])


async def generate(stub: pb_grpc.GeneratorStub, req: Drawn) -> Refused | dict:
    await asyncio.sleep(req.delay * 0.01)
    call = stub.Generate(req.message(), timeout=120)
    aborter = None
    if req.abort_after is not None:
        async def abort_later():
            await asyncio.sleep(req.abort_after * 0.01)
            await stub.Abort(pb.AbortRequest(request_id=req.req_id), timeout=30)
        aborter = asyncio.create_task(abort_later())
    try:
        responses = []
        while (resp := await call.read()) is not grpc.aio.EOF:
            responses.append(resp)
        return endings_of(response_messages(responses))
    except grpc.aio.AioRpcError as e:
        return Refused(e.code(), e.details())
    finally:
        if aborter is not None:
            await aborter


async def run_batch(address: str, batch: list[Drawn]) -> list[Refused | dict]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        return await asyncio.gather(*(generate(stub, r) for r in batch))


def batches(max_model_len: int, vocab_size: int):
    # Ids of ordinary tokens (past the specials), short outputs: the tiny model runs on CPU.
    alphabet = tuple(range(16, vocab_size))
    return request_batches(max_model_len, min_size=2, max_size=4, alphabet=alphabet,
                           stop_ids=alphabet[:64], stop_strings=("e", " t"), max_delay=5,
                           max_beam_width=3).map(
        lambda batch: [replace(r, max_tokens=1 + (r.max_tokens - 1) % 12) if r.max_tokens
                       else r for r in batch])


def test_every_request_ends_or_is_refused_and_the_server_ends_idle(server, shape):
    served, eos_ids, vocab_size = shape

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(batch=batches(served.max_model_len, vocab_size))
    def check(batch: list[Drawn]) -> None:
        outcomes = asyncio.run(run_batch(server.address, batch))
        for req, outcome in zip(batch, outcomes, strict=True):
            check_outcome(req, served, outcome, None, req.abort_after is not None, eos_ids)
            if (not isinstance(outcome, Refused) and req.temperature == 0 and req.n > 1
                    and req.beam_width == 1 and req.abort_after is None):
                assert len({tuple(e.token_ids) for e in outcome.values()}) == 1, outcome
        stats = wait_idle(server.address, timeout=30)
        assert stats["swap_blocks_free"] == stats["swap_blocks_total"], stats

    check()
    stats = wait_idle(server.address)
    assert stats["num_preemptions"] > 0, stats  # the pool was small enough to matter
