"""The host tier across executors: which of the blocks a retired scheduler's tier promised a
new executor may still read from the tier file the serving process owns.

    executor lost ──> retired BlockManager.host_index()  (slot -> key: every promise)
    new executor's Hello ──> the file's header must name its model, dtype and block layout
                        ──> each promised slot's records must be intact, name that key and
                            match their bytes (protos/kv_tier_file.py)
                        ──> the next BlockManager adopts the rest (adopt_host_blocks)

Anything that fails a check is dropped, never trusted: a file of another model or layout
(stale), a promise whose copy never ran or was cut off by the crash (torn), damaged memory.
At TP > 1 a slot is kept only if every rank's record vouches for it. `surviving_host_blocks`
blocks while it reads the blocks: the engine calls it on a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import structlog

from protos.kv_tier_file import HEADER_BYTES, TierFile, TierFileError, read_identity
from protos.plan import Hello

log = structlog.get_logger("folio.scheduler.host_tier")


def surviving_host_blocks(path: str | Path, hello: Hello,
                          promised: Mapping[int, bytes]) -> dict[int, bytes]:
    """Of `promised` (slot -> key, least recently used first), the slots the tier file at
    `path` still vouches for, for the executor that sent `hello`; {} when the file is missing,
    damaged, or describes other blocks than that executor's."""
    if not promised:
        return {}
    try:
        with open(path, "rb") as f:
            identity = read_identity(f.read(HEADER_BYTES))
    except (OSError, TierFileError) as e:
        log.warning("host tier file dropped: unreadable", path=str(path), error=str(e))
        return {}
    facts = (hello.model_name, hello.architecture, hello.kv_cache_dtype or hello.dtype,
             hello.block_size,
             hello.num_host_blocks, hello.tensor_parallel_size, tuple(hello.kv_windows))
    if facts != (identity.model_name, identity.architecture, identity.dtype,
                 identity.block_size, identity.num_slots, identity.tensor_parallel_size,
                 identity.kv_windows):
        log.warning("host tier file dropped: it holds other blocks than this executor's",
                    path=str(path), file_identity=identity.encode().decode())
        return {}
    tier = TierFile.open(path, identity)
    if tier is None:
        log.warning("host tier file dropped: damaged", path=str(path))
        return {}
    try:
        kept = tier.valid_slots(promised)
    finally:
        tier.close()
    log.info("host tier carried over", path=str(path), num_promised=len(promised),
             num_kept=len(kept))
    return {slot: key for slot, key in promised.items() if slot in kept}  # LRU order
