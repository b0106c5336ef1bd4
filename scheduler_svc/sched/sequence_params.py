"""How many sequences one public request asks for, and how they are chosen.

`n` sequences from one prompt either by parallel sampling (each sequence samples on its own,
with a seed derived from the request's) or, when `beam_width > 1`, by beam search (the `n`
best of `beam_width` beams). Validation lives in `scheduler_svc.api.inputs`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from scheduler_svc.sched.beam_search import EarlyStopping

MAX_N = 128  # sequences per request: each is a running sequence with its own KV blocks
MAX_BEAM_WIDTH = 32  # beams per request; every step reads 2 * width (or more) logprobs per beam
SEED_MASK = 2**63 - 1  # derived seeds stay in the executor's signed 64-bit range


@dataclass(frozen=True)
class SequenceParams:
    n: int = 1
    beam_width: int = 1  # > 1: beam search; temperature, top_p, top_k and seed do not apply
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = EarlyStopping.HEURISTIC

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def is_single(self) -> bool:
        """One plain sequence: the request runs exactly as before sequence groups existed."""
        return self.n == 1 and not self.is_beam_search


def sequence_seed(seed: int | None, index: int) -> int | None:
    """The seed of sequence `index` of a request seeded with `seed`.

    Sequence 0 keeps the request's seed, so its output equals the same request with n = 1;
    the others get a stable digest of (seed, index) — never Python's `hash()`, which changes
    between processes — so a seeded request with n > 1 is reproducible. Unseeded stays unseeded.
    """
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"folio-seq:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & SEED_MASK
