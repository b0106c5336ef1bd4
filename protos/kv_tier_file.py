"""The prefix cache's host tier as a file in shared memory: the layout both services read, and
the checks that decide what in it may be trusted.

The serving process (the scheduler) owns the file and its lifetime; the executor maps it and
writes blocks into it; after an executor crash the scheduler reads back which slots hold which
block and a restarted executor maps the same file, so the prefix cache outlives the executor.
Nothing read back is trusted without its checks: a header naming another model or block shape
drops the whole tier (stale), a slot whose record or contents fail their checksums is dropped
(torn: the writer died mid-write, or the memory was damaged).

    offset 0      header   MAGIC, FORMAT_VERSION, len, identity (JSON), sha256 of all before
    RECORDS_AT    records  [tensor_parallel_size][num_slots] x RECORD_BYTES
    data_offset   rank 0   codes   [num_slots] x block_bytes   (page aligned)
                           scales  [num_slots] x scale_bytes   (page aligned; int8 KV only)
                  rank 1   codes, scales ...                   (each rank page aligned)

A slot of a rank is its block's codes and, for an int8 KV cache, their per-position scales: two
ranges that are read, written and checked together. A record says what its rank's slot holds:
the block's prefix-cache key, the crc32 of the slot's codes then scales, a write counter, and a
crc32 of the record itself. Writers follow one order, so a
crash at any point leaves a slot either valid or detectably not: `invalidate` the record, write
the block, then `commit` the record (computed from the data as it now is). A slot is valid only
when every rank's record is valid, names the same key, and matches its data.

Torch-free (struct, zlib, mmap): the scheduler validates without the executor's libraries.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

MAGIC = b"FOLIOKVT"
FORMAT_VERSION = 2  # 2: scale regions, each rank's region page aligned
HEADER_BYTES = 4096
RECORDS_AT = HEADER_BYTES
MAX_KEY_BYTES = 40  # a prefix-cache key: sha256 (32), plus 2 bytes for KV groups > 0
# key length, key (padded), data crc32, write counter, record crc32 over everything before it
_RECORD = struct.Struct(f"<B{MAX_KEY_BYTES}sIQ")
RECORD_BYTES = 64
_EMPTY_RECORD = bytes(RECORD_BYTES)


@dataclass(frozen=True, kw_only=True)
class TierIdentity:
    """What the tier's blocks are KV of, and how they are laid out. Any difference from the
    header read back makes the whole tier stale."""

    model_name: str
    architecture: str
    dtype: str
    block_size: int
    block_bytes: int  # one slot of one rank: every layer's K and V codes, block_size positions
    num_slots: int
    tensor_parallel_size: int = 1
    kv_windows: tuple[int, ...] = (0,)
    scale_bytes: int = 0  # one slot of one rank: an int8 cache's K and V scales (else 0)

    def __post_init__(self):
        if min(self.block_size, self.block_bytes, self.num_slots, self.tensor_parallel_size) < 1:
            raise ValueError(f"a host tier needs at least one slot of one block, got {self}")
        if self.scale_bytes < 0:
            raise ValueError(f"a host tier's scale_bytes must be >= 0, got {self.scale_bytes}")

    @property
    def codes_region(self) -> int:
        """Bytes of one rank's codes, page aligned."""
        return _page_align(self.num_slots * self.block_bytes)

    @property
    def rank_region(self) -> int:
        """Bytes of one rank's codes and scales, page aligned."""
        return self.codes_region + _page_align(self.num_slots * self.scale_bytes)

    def encode(self) -> bytes:
        return json.dumps({**asdict(self), "kv_windows": list(self.kv_windows)},
                          sort_keys=True).encode()


class TierFileError(ValueError):
    """The file cannot be a host tier at all (too short, unreadable header)."""


def _page_align(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


class TierFile:
    """A mapped tier file. Invariants: the header matches `identity`; the file is exactly
    `size` bytes; records and data sit at the offsets the module docstring draws."""

    def __init__(self, path: Path, identity: TierIdentity, mm: mmap.mmap):
        self.path = path
        self.identity = identity
        self._mm = mm
        n = identity.tensor_parallel_size * identity.num_slots
        self.data_offset = _page_align(RECORDS_AT + n * RECORD_BYTES)
        self._writes = 0

    @staticmethod
    def size_for(identity: TierIdentity) -> int:
        n = identity.tensor_parallel_size * identity.num_slots
        return (_page_align(RECORDS_AT + n * RECORD_BYTES)
                + identity.tensor_parallel_size * identity.rank_region)

    @classmethod
    def create(cls, path: str | Path, identity: TierIdentity) -> TierFile:
        """A fresh tier at `path` (replacing any file there): the header, every record empty."""
        path = Path(path)
        encoded = identity.encode()
        head = MAGIC + struct.pack("<II", FORMAT_VERSION, len(encoded)) + encoded
        if len(head) + 32 > HEADER_BYTES:
            raise ValueError("the host tier's identity does not fit its header")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, cls.size_for(identity))  # zero-filled: every record empty
            mm = mmap.mmap(fd, cls.size_for(identity))
        finally:
            os.close(fd)
        mm[:len(head) + 32] = head + hashlib.sha256(head).digest()
        return cls(path, identity, mm)

    @classmethod
    def open(cls, path: str | Path, identity: TierIdentity) -> TierFile | None:
        """The tier at `path` if its header is intact and names exactly `identity`; None if
        there is no file or it is stale or damaged (the caller then creates a fresh one)."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size != cls.size_for(identity):
                return None
            mm = mmap.mmap(fd, cls.size_for(identity))
        finally:
            os.close(fd)
        try:
            found = read_identity(mm)
        except TierFileError:
            found = None
        if found != identity:
            mm.close()
            return None
        return cls(path, identity, mm)

    # ---- the data ---------------------------------------------------------------------------

    def slot_offset(self, rank: int, slot: int) -> int:
        """Where `rank`'s codes of `slot` start in the file (block_bytes long)."""
        self._check(rank, slot)
        return (self.data_offset + rank * self.identity.rank_region
                + slot * self.identity.block_bytes)

    def scale_offset(self, rank: int, slot: int) -> int:
        """Where `rank`'s scales of `slot` start in the file (scale_bytes long)."""
        self._check(rank, slot)
        return (self.data_offset + rank * self.identity.rank_region
                + self.identity.codes_region + slot * self.identity.scale_bytes)

    def data(self, rank: int) -> memoryview:
        """`rank`'s codes, [num_slots x block_bytes], for the executor to map as a tensor
        (writable: the memory is shared, not copied)."""
        start = self.slot_offset(rank, 0)
        return memoryview(self._mm)[start:start + self.identity.num_slots *
                                    self.identity.block_bytes]

    def scales(self, rank: int) -> memoryview:
        """`rank`'s scales, [num_slots x scale_bytes] (empty without them), mapped alike."""
        start = self.scale_offset(rank, 0)
        return memoryview(self._mm)[start:start + self.identity.num_slots *
                                    self.identity.scale_bytes]

    def _slot_crc(self, rank: int, slot: int) -> int:
        """The crc32 of `rank`'s slot: its codes, then its scales."""
        codes, scales = self.slot_offset(rank, slot), self.scale_offset(rank, slot)
        view = memoryview(self._mm)
        crc = zlib.crc32(view[codes:codes + self.identity.block_bytes])
        return zlib.crc32(view[scales:scales + self.identity.scale_bytes], crc)

    # ---- records ---------------------------------------------------------------------------

    def _record_at(self, rank: int, slot: int) -> int:
        self._check(rank, slot)
        return RECORDS_AT + (rank * self.identity.num_slots + slot) * RECORD_BYTES

    def invalidate(self, rank: int, slot: int) -> None:
        """Before writing a slot: its record no longer vouches for anything."""
        at = self._record_at(rank, slot)
        self._mm[at:at + RECORD_BYTES] = _EMPTY_RECORD

    def commit(self, rank: int, slot: int, key: bytes) -> None:
        """After the slot's block is completely written: the record names `key` and vouches
        for the data as it is now."""
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a prefix-cache key of {len(key)} bytes does not fit a record")
        self._writes += 1
        body = _RECORD.pack(len(key), key, self._slot_crc(rank, slot), self._writes)
        at = self._record_at(rank, slot)
        record = body + struct.pack("<I", zlib.crc32(body))
        self._mm[at:at + RECORD_BYTES] = record.ljust(RECORD_BYTES, b"\0")

    def record_key(self, rank: int, slot: int) -> bytes | None:
        """The key `rank`'s record of `slot` names if the record is intact and its data
        matches it; else None (empty, torn or damaged)."""
        at = self._record_at(rank, slot)
        raw = bytes(self._mm[at:at + _RECORD.size + 4])
        body, (crc,) = raw[:_RECORD.size], struct.unpack("<I", raw[_RECORD.size:])
        if body == bytes(_RECORD.size) or zlib.crc32(body) != crc:
            return None
        key_len, key, data_crc, _ = _RECORD.unpack(body)
        if not 0 < key_len <= MAX_KEY_BYTES or any(key[key_len:]):
            return None
        if self._slot_crc(rank, slot) != data_crc:
            return None
        return key[:key_len]

    def valid_slots(self, promised: Mapping[int, bytes]) -> dict[int, bytes]:
        """Of the slots the scheduler believes hold a key (`promised`: slot -> key), those whose
        every rank's record is intact, names that key and matches its data."""
        tp = self.identity.tensor_parallel_size
        return {slot: key for slot, key in promised.items()
                if 0 <= slot < self.identity.num_slots
                and all(self.record_key(r, slot) == key for r in range(tp))}

    def committed_slots(self) -> dict[int, bytes]:
        """Every slot valid on all ranks, with its key: what a tier adopted with no other
        knowledge of it may hold."""
        tp, num_slots = self.identity.tensor_parallel_size, self.identity.num_slots
        found: dict[int, bytes] = {}
        for slot in range(num_slots):
            key = self.record_key(0, slot)
            if key is not None and all(self.record_key(r, slot) == key for r in range(1, tp)):
                found[slot] = key
        return found

    def invalidate_all(self, slots: Iterable[int]) -> None:
        for slot in slots:
            for rank in range(self.identity.tensor_parallel_size):
                self.invalidate(rank, slot)

    def _check(self, rank: int, slot: int) -> None:
        if not (0 <= rank < self.identity.tensor_parallel_size
                and 0 <= slot < self.identity.num_slots):
            raise IndexError(f"host tier slot {slot} of rank {rank} is outside "
                             f"{self.identity.num_slots} slots x "
                             f"{self.identity.tensor_parallel_size} ranks")

    def close(self) -> None:
        self._mm.close()


def read_identity(buf) -> TierIdentity:
    """The identity a tier file's header states, after checking its magic, version and digest."""
    if len(buf) < HEADER_BYTES or bytes(buf[:len(MAGIC)]) != MAGIC:
        raise TierFileError("not a Folio host tier file")
    version, length = struct.unpack("<II", buf[len(MAGIC):len(MAGIC) + 8])
    end = len(MAGIC) + 8 + length
    if version != FORMAT_VERSION or end + 32 > HEADER_BYTES:
        raise TierFileError(f"host tier file format {version}, expected {FORMAT_VERSION}")
    if hashlib.sha256(bytes(buf[:end])).digest() != bytes(buf[end:end + 32]):
        raise TierFileError("the host tier file's header is damaged")
    try:
        fields = json.loads(bytes(buf[len(MAGIC) + 8:end]))
        fields["kv_windows"] = tuple(fields["kv_windows"])
        return TierIdentity(**fields)
    except (ValueError, TypeError, KeyError) as e:
        raise TierFileError(f"the host tier file's identity is unreadable: {e}") from e
