"""TierRecords keeps a tier file's records true around asynchronous copies: a record is empty
from the moment a copy into its slot is queued until that copy has landed; commits happen in
order, a newer copy into a slot supersedes an older pending commit, and `wait` settles all.
The copies' completion is played by events that say when they are done."""

from __future__ import annotations

from executor_svc.kv.host_tier import TierRecords
from protos.kv_tier_file import TierFile, TierIdentity

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
