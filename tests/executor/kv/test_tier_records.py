"""TierRecords keeps a tier file's records true around asynchronous copies: a record is empty
from the moment a copy into its slot is queued until that copy has landed; commits happen in
order, a newer copy into a slot supersedes an older pending commit, and `wait` settles all.
The copies' completion is played by events that say when they are done. Two gloo ranks share
one tier file: rank 0 creates or validates it, both map their own records and blocks, and a
slot a rank left torn is not vouched for."""

from __future__ import annotations

import torch

from executor_svc.kv.host_tier import TierRecords, open_tier_file
from executor_svc.parallel import distributed
from protos.kv_tier_file import TierFile, TierIdentity
from tests.executor.parallel.tp_procs import run_ranks

IDENTITY = TierIdentity(model_name="m", architecture="a", dtype="float32", block_size=4,
                        block_bytes=16, num_slots=4)


class Copy:
    """An event for a queued copy: not done until `land()`."""

    def __init__(self):
        self.done = False

    def land(self):
        self.done = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_records_follow_the_copies(tmp_path):
    tier = TierFile.create(tmp_path / "t", IDENTITY)
    records = TierRecords(tier, rank=0)
    records.before_copy([0, 1])
    records.after_copy([(0, b"k0"), (1, b"k1")], None)  # landed already (the CPU backend)
    assert tier.committed_slots() == {0: b"k0", 1: b"k1"}
    first, second = Copy(), Copy()
    records.before_copy([1, 2])
    assert tier.committed_slots() == {0: b"k0"}  # slot 1 is being rewritten: not vouched for
    records.after_copy([(1, b"k1b"), (2, b"k2")], first)
    records.before_copy([2, 3])  # a newer copy into slot 2 supersedes the pending commit
    records.after_copy([(2, b"k2b"), (3, b"k3")], second)
    second.land()
    records.commit_completed()  # in order: the first copy has not landed, so nothing yet
    assert tier.committed_slots() == {0: b"k0"}
    first.land()
    records.commit_completed()
    assert tier.committed_slots() == {0: b"k0", 1: b"k1b", 2: b"k2b", 3: b"k3"}
    third = Copy()
    records.before_copy([0])
    records.after_copy([(0, b"k0b")], third)
    records.commit_completed(wait=True)  # waits for the copy
    assert tier.committed_slots()[0] == b"k0b"


TP_IDENTITY = TierIdentity(model_name="m", architecture="a", dtype="float32", block_size=4,
                           block_bytes=16, num_slots=4, tensor_parallel_size=2)


def _rank_writes_its_part(rank: int, path: str) -> None:
    def barrier():
        distributed.barrier(torch.device("cpu"))

    tier = open_tier_file(path, TP_IDENTITY, rank, barrier)
    records = TierRecords(tier, rank)
    records.before_copy([0, 1, 2])
    for slot in (0, 1, 2):
        tier.data(rank)[slot * 16:(slot + 1) * 16] = bytes([10 * rank + slot]) * 16
    # rank 1 dies before its copy into slot 2 lands: that record stays empty
    records.after_copy([(0, b"k0"), (1, b"k1")] + ([(2, b"k2")] if rank == 0 else []), None)
    tier.close()
    barrier()  # a restarted group: rank 0 keeps the file (same identity), rank 1 maps it
    tier = open_tier_file(path, TP_IDENTITY, rank, barrier)
    assert bytes(tier.data(rank)[16:32]) == bytes([10 * rank + 1]) * 16
    assert tier.committed_slots() == {0: b"k0", 1: b"k1"}
    tier.close()


def test_two_ranks_share_one_file(tmp_path):
    path = tmp_path / "tier"
    run_ranks(_rank_writes_its_part, 2, str(path), timeout_s=120)
    tier = TierFile.open(path, TP_IDENTITY)
    assert tier.record_key(0, 2) == b"k2" and tier.record_key(1, 2) is None
    assert tier.valid_slots({0: b"k0", 1: b"k1", 2: b"k2"}) == {0: b"k0", 1: b"k1"}
    assert bytes(tier.data(1)[:16]) == bytes([10]) * 16  # each rank wrote its own region
