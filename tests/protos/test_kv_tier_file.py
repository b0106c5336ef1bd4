"""The host tier's shared-memory file: what is committed reads back with its key; a torn write
(a writer killed between invalidate and commit, a half-written record), damaged data, a header
of another model or block shape, a file of the wrong size or of random bytes are all detected
and dropped, never trusted. An int8 cache's slots carry their scales, which the crc32 covers;
a file of the previous format (no scale regions) is stale."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest

from protos.kv_tier_file import (
    MAGIC,
    RECORDS_AT,
    TierFile,
    TierFileError,
    TierIdentity,
    read_identity,
)

IDENTITY = TierIdentity(model_name="tiny", architecture="Qwen2ForCausalLM", dtype="float32",
                        block_size=4, block_bytes=256, num_slots=8, tensor_parallel_size=2)
KEY_A, KEY_B = hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest() + b"\x01\x00"


def write(tier: TierFile, rank: int, slot: int, key: bytes, fill: int) -> None:
    """The writer's order: invalidate, write the block, commit."""
    tier.invalidate(rank, slot)
    tier.data(rank)[slot * 256:(slot + 1) * 256] = bytes([fill]) * 256
    tier.commit(rank, slot, key)


def test_committed_slots_read_back_after_reopening(tmp_path):
    tier = TierFile.create(tmp_path / "t", IDENTITY)
    for rank in (0, 1):
        write(tier, rank, 3, KEY_A, 7)
        write(tier, rank, 5, KEY_B, 9)
    write(tier, 0, 6, KEY_A, 1)  # rank 1 never wrote slot 6
    tier.close()
    again = TierFile.open(tmp_path / "t", IDENTITY)
    assert again is not None
    assert again.committed_slots() == {3: KEY_A, 5: KEY_B}
    assert again.valid_slots({3: KEY_A, 5: KEY_A, 6: KEY_A, 7: KEY_B}) == {3: KEY_A}
    assert bytes(again.data(1)[5 * 256:6 * 256]) == bytes([9]) * 256


def test_torn_and_damaged_slots_are_dropped(tmp_path):
    tier = TierFile.create(tmp_path / "t", IDENTITY)
    for slot in range(4):
        for rank in (0, 1):
            write(tier, rank, slot, KEY_A, slot)
    tier.invalidate(0, 0)  # killed after invalidating, before the commit
    tier.data(1)[1 * 256 + 17] ^= 0xFF  # the block changed after its commit
    at = RECORDS_AT + (0 * 8 + 2) * 64  # a record half overwritten
    with open(tmp_path / "t", "r+b") as f:
        f.seek(at + 5)
        f.write(b"\xAA\xBB")
    assert tier.committed_slots() == {3: KEY_A}
    assert tier.record_key(1, 0) == KEY_A and tier.record_key(0, 0) is None


@pytest.mark.parametrize("change", [
    dict(model_name="other"), dict(dtype="bfloat16"), dict(block_size=8),
    dict(architecture="LlamaForCausalLM"), dict(kv_windows=(0, 16)), dict(scale_bytes=64),
])
def test_a_tier_of_another_model_or_shape_is_stale(tmp_path, change):
    TierFile.create(tmp_path / "t", IDENTITY).close()
    other = TierIdentity(**{**IDENTITY.__dict__, **change})
    assert TierFile.open(tmp_path / "t", other) is None
    assert TierFile.open(tmp_path / "t", IDENTITY) is not None


def test_missing_resized_damaged_and_random_files_are_refused(tmp_path):
    assert TierFile.open(tmp_path / "missing", IDENTITY) is None
    path = tmp_path / "t"
    TierFile.create(path, IDENTITY).close()
    with open(path, "r+b") as f:
        f.truncate(TierFile.size_for(IDENTITY) - 1)
    assert TierFile.open(path, IDENTITY) is None
    TierFile.create(path, IDENTITY).close()
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"X")  # inside the identity: the digest no longer matches
    assert TierFile.open(path, IDENTITY) is None
    with open(path, "rb") as f:
        with pytest.raises(TierFileError, match="damaged"):
            read_identity(f.read(4096))
    path.write_bytes(os.urandom(TierFile.size_for(IDENTITY)))
    assert TierFile.open(path, IDENTITY) is None


def test_bad_arguments_are_refused(tmp_path):
    tier = TierFile.create(tmp_path / "t", IDENTITY)
    with pytest.raises(IndexError, match="slot 8 of rank 0 is outside 8 slots x 2 ranks"):
        tier.commit(0, 8, KEY_A)
    with pytest.raises(ValueError, match="key of 41 bytes"):
        tier.commit(0, 0, bytes(41))
    with pytest.raises(ValueError, match="at least one slot"):
        TierIdentity(model_name="m", architecture="a", dtype="f", block_size=4, block_bytes=8,
                     num_slots=0)


INT8 = TierIdentity(**{**IDENTITY.__dict__, "dtype": "int8", "scale_bytes": 48})


def test_scales_are_part_of_their_slot(tmp_path):
    """Each rank's slot is its codes and its scales; changing a slot's scales alone drops it,
    and no rank's or slot's scales overlap another's or any codes."""
    tier = TierFile.create(tmp_path / "t", INT8)
    for rank in (0, 1):
        for slot in range(3):
            tier.invalidate(rank, slot)
            tier.data(rank)[slot * 256:(slot + 1) * 256] = bytes([slot + 1]) * 256
            tier.scales(rank)[slot * 48:(slot + 1) * 48] = bytes([100 + 10 * rank + slot]) * 48
            tier.commit(rank, slot, KEY_A)
    tier.scales(1)[2 * 48 + 5] ^= 0xFF  # rank 1's scales of slot 2 damaged
    tier.close()
    again = TierFile.open(tmp_path / "t", INT8)
    assert again.committed_slots() == {0: KEY_A, 1: KEY_A}
    assert bytes(again.scales(0)[48:96]) == bytes([101]) * 48
    assert bytes(again.data(1)[256:512]) == bytes([2]) * 256
    ranges = sorted([(again.slot_offset(r, s), 256) for r in (0, 1) for s in range(8)]
                    + [(again.scale_offset(r, s), 48) for r in (0, 1) for s in range(8)])
    assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
    assert ranges[-1][0] + ranges[-1][1] <= TierFile.size_for(INT8)


def test_a_file_of_the_previous_format_is_stale(tmp_path):
    """A version-1 file (no scale regions) is not read as this format's, whatever it holds."""
    path = tmp_path / "t"
    TierFile.create(path, IDENTITY).close()
    encoded = json.dumps({k: v for k, v in IDENTITY.__dict__.items() if k != "scale_bytes"}
                         ).encode()
    head = MAGIC + struct.pack("<II", 1, len(encoded)) + encoded
    with open(path, "r+b") as f:
        f.write(head + hashlib.sha256(head).digest())
    with pytest.raises(TierFileError, match="format 1"):
        with open(path, "rb") as f:
            read_identity(f.read(4096))
    assert TierFile.open(path, IDENTITY) is None
