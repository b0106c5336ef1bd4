"""What a new executor inherits of the host tier: the retired scheduler's promises that the
tier file still vouches for, in LRU order; nothing from a missing, damaged or foreign file; at
TP = 2 nothing one rank does not vouch for. The engine checks on a worker thread while its loop
keeps answering, and adopts only once the check returns."""

from __future__ import annotations

import asyncio
import hashlib
import threading

import grpc
import pytest

from protos.kv_tier_file import TierFile, TierIdentity
from scheduler_svc.engine import engine as engine_module
from scheduler_svc.engine.host_tier import surviving_host_blocks
from tests.scheduler.grpc_harness import (
    NOT_SERVING,
    SERVING,
    collect,
    gen_request,
    null_continuation,
    running_server,
)
from tests.scheduler.null_executor import make_hello

HELLO = make_hello(num_host_blocks=6)
IDENTITY = TierIdentity(model_name="tiny", architecture="LlamaForCausalLM", dtype="float32",
                        block_size=4, block_bytes=64, num_slots=6)
KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(6)]


@pytest.fixture
def tier_path(tmp_path):
    path = tmp_path / "tier"
    tier = TierFile.create(path, IDENTITY)
    for slot in (4, 1, 2):
        tier.invalidate(0, slot)
        tier.data(0)[slot * 64:(slot + 1) * 64] = bytes([slot + 1]) * 64
        tier.commit(0, slot, KEYS[slot])
    tier.invalidate(0, 2)  # cut off by the crash before its commit
    tier.close()
    return path


def test_kept_promises_in_lru_order(tier_path):
    promised = {4: KEYS[4], 2: KEYS[2], 1: KEYS[1], 3: KEYS[3], 0: KEYS[5]}
    kept = surviving_host_blocks(tier_path, HELLO, promised)
    assert list(kept.items()) == [(4, KEYS[4]), (1, KEYS[1])]


@pytest.mark.parametrize("change", [dict(model_name="other"), dict(dtype="bfloat16"),
                                    dict(block_size=8), dict(num_host_blocks=7),
                                    dict(kv_windows=[0, 16]), dict(tensor_parallel_size=2)])
def test_a_file_of_other_blocks_is_dropped(tier_path, change):
    hello = make_hello(**{"num_host_blocks": 6, **change})
    assert surviving_host_blocks(tier_path, hello, {4: KEYS[4]}) == {}


def test_missing_and_damaged_files_are_dropped(tier_path, tmp_path):
    assert surviving_host_blocks(tmp_path / "none", HELLO, {4: KEYS[4]}) == {}
    with open(tier_path, "r+b") as f:
        f.seek(30)
        f.write(b"#")
    assert surviving_host_blocks(tier_path, HELLO, {4: KEYS[4]}) == {}


def test_a_slot_torn_on_one_rank_only_is_dropped(tmp_path):
    """At TP = 2 a slot carries over only when both ranks' records name its key: rank 1's
    record torn (its copy cut off), or its bytes changed, drops that slot alone."""
    identity = TierIdentity(model_name="tiny", architecture="LlamaForCausalLM",
                            dtype="float32", block_size=4, block_bytes=64, num_slots=6,
                            tensor_parallel_size=2)
    path = tmp_path / "tier"
    tier = TierFile.create(path, identity)
    for rank in (0, 1):
        for slot in range(4):
            tier.invalidate(rank, slot)
            tier.data(rank)[slot * 64:(slot + 1) * 64] = bytes([10 * rank + slot]) * 64
            tier.commit(rank, slot, KEYS[slot])
    tier.invalidate(1, 2)  # rank 1 was rewriting slot 2 when the executor died
    tier.data(1)[3 * 64] ^= 0xFF  # rank 1's copy of slot 3 damaged
    tier.close()
    hello = make_hello(num_host_blocks=6, tensor_parallel_size=2)
    promised = {slot: KEYS[slot] for slot in range(4)}
    assert surviving_host_blocks(path, hello, promised) == {0: KEYS[0], 1: KEYS[1]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flush", ["never", "while_checking", "before_hello"])
async def test_the_check_runs_off_the_event_loop(tiny_tokenizer, tier_path, monkeypatch, flush):
    """A new executor's Hello starts the check of the tier file on a worker thread: held
    there, the server still answers health checks (not yet serving) and refuses requests
    rather than queueing them ahead of the adoption; once the check returns the kept blocks
    are adopted and the server serves. A flush while no executor serves (before its Hello, or
    while the check runs) means nothing is adopted."""
    gate, entered, gave_up = threading.Event(), threading.Event(), threading.Event()

    def gated(*args):
        entered.set()
        if not gate.wait(10):  # a check on the loop blocks the test too: it never gets here
            gave_up.set()
        return surviving_host_blocks(*args)

    monkeypatch.setattr(engine_module, "surviving_host_blocks", gated)
    async with running_server(tiny_tokenizer, kv_offloading_size=0.001,
                              kv_offloading_path=str(tier_path)) as harness:
        engine = harness.server.engine
        engine._host_index = {4: KEYS[4], 2: KEYS[2], 1: KEYS[1]}  # a retired tier's promises
        if flush == "before_hello":
            assert (await engine.flush_prefix_cache(0))[0]
        harness.connect(hello=HELLO)
        if flush == "before_hello":  # nothing promised: no check at all
            await harness.wait_health(SERVING)
            assert (await harness.stats()).host_kv_blocks_cached == 0 and not entered.is_set()
            return
        assert await asyncio.to_thread(entered.wait, 10)
        for _ in range(3):  # the loop answers while the check is held on its thread
            assert await asyncio.wait_for(harness.health_status(), 2) == NOT_SERVING
        assert not gave_up.is_set(), "the check held the event loop"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(harness.stub.Generate(gen_request(max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        if flush == "while_checking":
            assert (await engine.flush_prefix_cache(0))[0]
        gate.set()
        await harness.wait_health(SERVING)
        stats = await harness.stats()
        assert stats.host_kv_blocks_cached == (0 if flush == "while_checking" else 2)  # 2 torn
        responses = await collect(harness.stub.Generate(gen_request(max_tokens=2)))
        assert [t for r in responses for t in r.token_ids] == null_continuation([5, 6, 7], 2)
