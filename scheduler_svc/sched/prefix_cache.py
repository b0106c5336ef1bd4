"""Content keys for automatic prefix caching.

A full KV block is identified by what determines its contents: every token before it and its own
tokens. Chaining makes that cheap: a block's key is a digest of its parent block's key, a salt
and its own token ids, so two sequences share block k's key exactly when their first
(k + 1) * block_size tokens and their salts agree.

    key(0) = sha256(b""      | salt | tokens[0:bs])
    key(k) = sha256(key(k-1) | salt | tokens[k*bs:(k+1)*bs])

The salt (`Request.cache_salt`, empty by default) isolates tenants or adapters: different salts
never share a block. The digest is sha256, stable across processes and runs; Python's hash() is
salted per process and collides far too easily to stand for KV contents.

The functions at the end are the scheduler's use of the keys: a request's keys grow with its
tokens (`Request.block_keys`), an admitted request starts from the cached blocks of its leading
tokens, and a step's full computed blocks are offered to the cache.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.sched.block_manager import BlockManager
    from scheduler_svc.sched.request import Request


def block_key(parent_key: bytes | None, token_ids: Sequence[int], salt: str = "") -> bytes:
    """The key of one full block, chained on its parent's key (None for the first block)."""
    h = hashlib.sha256()
    h.update(parent_key or b"")
    salt_bytes = salt.encode()
    # Length prefixes keep the fields apart: no (salt, tokens) pair can mimic another.
    h.update(struct.pack("<I", len(salt_bytes)))
    h.update(salt_bytes)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    return h.digest()


def extend_block_keys(keys: list[bytes], token_ids: Sequence[int], block_size: int,
                      salt: str = "") -> list[bytes]:
    """Append the keys of the full blocks of `token_ids` that `keys` does not cover yet.

    `keys` must be the keys of the leading blocks of the same token sequence (as returned by an
    earlier call); sequences only grow, so the existing keys stay valid. Returns `keys`."""
    num_full = len(token_ids) // block_size
    for k in range(len(keys), num_full):
        parent = keys[k - 1] if k else None
        keys.append(block_key(parent, token_ids[k * block_size:(k + 1) * block_size], salt))
    return keys


# ---- a request's blocks and the cache (the scheduler's side) ---------------------------------

def request_block_keys(req: Request, num_tokens: int, block_size: int) -> list[bytes]:
    """`req.block_keys`, extended to cover (at least) its first `num_tokens` tokens."""
    if num_tokens // block_size > len(req.block_keys):
        extend_block_keys(req.block_keys, req.all_token_ids, block_size, req.cache_salt)
    return req.block_keys


def cached_prefix(bm: BlockManager, req: Request) -> list[int]:
    """Blocks of the prefix cache holding `req`'s leading tokens. At least the last token is
    left to compute, so the request samples; only full blocks are ever shared."""
    keys = request_block_keys(req, req.num_tokens, bm.block_size)
    return bm.cached_prefix(keys[:(req.num_tokens - 1) // bm.block_size])


def cache_computed_blocks(bm: BlockManager, req: Request) -> None:
    """Offer `req`'s full, computed blocks to the cache (after the step that wrote them).

    Under overlapped scheduling num_computed_tokens may count a position whose token is still
    in flight; only blocks of known tokens get a key. A block keyed here may still be written
    by the step in flight, but any plan that reuses it runs after that step."""
    num_full = min(req.num_computed_tokens, req.num_tokens) // bm.block_size
    if num_full <= bm.num_offered(req.req_id):
        return  # no block filled up since the last offer (most decode steps): nothing to key
    keys = request_block_keys(req, req.num_computed_tokens, bm.block_size)[:num_full]
    bm.cache_blocks(req.req_id, keys, req.all_token_ids if bm.events is not None else (),
                    req.cache_salt)


def cache_computed_blocks_many(bm: BlockManager, reqs: list[Request]) -> None:
    """`cache_computed_blocks` for each of `reqs`, with its no-op case (no block filled up
    since the last offer: most requests at most steps) checked inline."""
    block_size, num_offered = bm.block_size, bm.num_offered
    for req in reqs:
        num_known = len(req.prompt_token_ids) + len(req.output_token_ids)
        num_full = min(req.num_computed_tokens, num_known) // block_size
        if num_full > num_offered(req.req_id):
            cache_computed_blocks(bm, req)

