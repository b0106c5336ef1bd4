"""A null-model executor that tracks what every KV slot holds, for tests of shared blocks.

`KVMirror` follows protocol v2 (new/cached requests, `new_token_ids`, `append_sampled`,
`num_logprobs`, block copies, swaps) and records, for each slot it writes, the token prefix
whose last position it computed. Before a request computes, every earlier position of its block
table must hold exactly its own prefix, so a block shared wrongly (a sibling overwrote it, a
copy-on-write that never happened, a block freed while in use) fails the step. Writes are only
allowed into blocks no other live request's table names: the copy-on-write rule.

The "model" is deterministic: logits over a small vocabulary from a digest of the sequence, so
beam search through the scheduler can be compared with `BeamSearch` driven directly.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field

from protos.plan import SamplingSpec, StepPlan, StepResult

VOCAB = list(range(10, 74))  # never a special id (< 10)


def null_logprobs(token_ids: list[int]) -> list[tuple[int, float]]:
    """log_softmax of digest-derived logits, as (token id, float32 logprob), best first."""
    digest = hashlib.blake2b(struct.pack(f"<{len(token_ids)}I", *token_ids),
                             digest_size=len(VOCAB)).digest()
    logits = [b / 16.0 for b in digest]
    top = max(logits)
    log_norm = top + math.log(sum(math.exp(x - top) for x in logits))
    pairs = [(t, struct.unpack("f", struct.pack("f", x - log_norm))[0])
             for t, x in zip(VOCAB, logits, strict=True)]
    return sorted(pairs, key=lambda p: (-p[1], p[0]))


def null_sample(token_ids: list[int], spec: SamplingSpec) -> int:
    """Greedy: the best token. Sampled: a digest of (seed, sequence), so seeded is reproducible
    and sequences with different seeds part ways."""
    if spec.temperature == 0:
        return null_logprobs(token_ids)[0][0]
    key = f"{spec.seed}:{token_ids}".encode()
    return VOCAB[int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
                 % len(VOCAB)]


class MirrorViolation(AssertionError):
    pass


@dataclass
class _Req:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingSpec


@dataclass
class KVMirror:
    block_size: int
    reqs: dict[str, _Req] = field(default_factory=dict)
    slots: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)  # gpu
    cpu_slots: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    num_copies: int = 0
    num_scheduled_tokens: int = 0

    def apply(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            if self.reqs.pop(req_id, None) is None:
                raise MirrorViolation(f"step {plan.step_id}: dropping unknown {req_id}")
        scheduled: list[tuple[str, int]] = []
        for new in plan.new_reqs:  # a held request sent again replaces the executor's copy
            self.reqs[new.req_id] = _Req(list(new.token_ids), list(new.block_ids),
                                         new.num_computed_tokens, new.sampling)
            scheduled.append((new.req_id, new.num_scheduled_tokens))
        for cached in plan.cached_reqs:
            req = self.reqs.get(cached.req_id)
            if req is None or cached.num_computed_tokens != req.num_computed_tokens:
                raise MirrorViolation(f"step {plan.step_id}: cached {cached.req_id} unknown "
                                      "or with a wrong computed count")
            if cached.new_token_ids and req.sampling.append_sampled:
                raise MirrorViolation(f"step {plan.step_id}: new_token_ids for "
                                      f"{cached.req_id}, which appends what it samples")
            req.block_ids.extend(cached.new_block_ids)
            req.token_ids.extend(cached.new_token_ids)
            scheduled.append((cached.req_id, cached.num_scheduled_tokens))
        self._move(plan.swap_out, self.slots, self.cpu_slots)
        self._move(plan.swap_in, self.cpu_slots, self.slots)
        self._move(plan.block_copies, self.slots, self.slots)
        self.num_copies += len(plan.block_copies)
        sampled, logprobs = [], []
        for req_id, num_scheduled in scheduled:
            req = self.reqs[req_id]
            end = req.num_computed_tokens + num_scheduled
            if num_scheduled < 1 or end > len(req.token_ids) \
                    or len(req.block_ids) * self.block_size < end:
                raise MirrorViolation(f"step {plan.step_id}: {req_id} cannot compute "
                                      f"{req.num_computed_tokens}..{end}")
            self._check_prefix(plan.step_id, req_id, req)
            self._write(plan.step_id, req_id, req, end)
            self.num_scheduled_tokens += num_scheduled
            if end == len(req.token_ids):
                token = null_sample(req.token_ids, req.sampling)
                sampled.append((req_id, [token]))
                if req.sampling.num_logprobs:
                    top = null_logprobs(req.token_ids)[:req.sampling.num_logprobs]
                    logprobs.append((req_id, [t for t, _ in top], [lp for _, lp in top]))
                if req.sampling.append_sampled:
                    req.token_ids.append(token)
        return StepResult(plan.step_id, sampled, 0.0, logprobs)

    def _move(self, pairs, src: dict, dst: dict) -> None:
        for a, b in pairs:
            for offset in range(self.block_size):
                value = src.get((a, offset))
                if value is None:
                    dst.pop((b, offset), None)
                else:
                    dst[(b, offset)] = value

    def _slot(self, req: _Req, pos: int) -> tuple[int, int]:
        return req.block_ids[pos // self.block_size], pos % self.block_size

    def _check_prefix(self, step_id: int, req_id: str, req: _Req) -> None:
        for pos in range(req.num_computed_tokens):
            if self.slots.get(self._slot(req, pos)) != tuple(req.token_ids[:pos + 1]):
                raise MirrorViolation(f"step {step_id}: {req_id} position {pos} in block "
                                      f"{self._slot(req, pos)[0]} holds another sequence's KV")

    def _write(self, step_id: int, req_id: str, req: _Req, end: int) -> None:
        for pos in range(req.num_computed_tokens, end):
            block_id, offset = self._slot(req, pos)
            others = [r for r, o in self.reqs.items() if r != req_id and block_id in o.block_ids]
            if others:
                raise MirrorViolation(f"step {step_id}: {req_id} writes block {block_id}, "
                                      f"shared with {others} (copy-on-write missing)")
            self.slots[(block_id, offset)] = tuple(req.token_ids[:pos + 1])
        req.num_computed_tokens = end
