"""What a new executor inherits of the host tier: the retired scheduler's promises that the
tier file still vouches for, in LRU order; nothing from a missing, damaged or foreign file."""

from __future__ import annotations

import hashlib

import pytest

from protos.kv_tier_file import TierFile, TierIdentity
from scheduler_svc.engine.host_tier import surviving_host_blocks
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
