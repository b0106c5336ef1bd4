"""A null-model executor that tracks what every KV slot holds, for tests of shared blocks.

`KVMirror` follows the step-plan protocol (new/cached requests, `new_token_ids`,
`append_sampled`, top, sampled and prompt logprobs (executor_svc/step/inputs.py's positions),
min_tokens masking, block copies, swaps, reset, and
speculative decoding: `CachedRequest.spec_token_ids` verified as executor_svc/spec/verifier.py
does, and with `num_draft_tokens` > 0 a draft model's `StepResult.proposals` as
executor_svc/spec/draft.py makes them) and records, for each slot it writes, a digest of the token
prefix whose last position it computed. Before a request computes, every earlier position of
its block table must hold exactly its own prefix, so a block shared wrongly (a sibling overwrote
it, a copy-on-write that never happened, a block freed while in use) fails the step. Writes are
only allowed into blocks no other live request's table names: the copy-on-write rule.

The "model" (`NullModel`) is deterministic: logits over a small vocabulary from a digest of the
sequence (or of its last `context` tokens, so greedy runs fall into loops that n-gram proposals
predict), so beam search through the scheduler can be compared with `BeamSearch` driven
directly, and any run with `NullModel.continuation`.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from protos.plan import PromptLogprobs, SamplingSpec, StepPlan, StepResult
from tests.scheduler.null_executor import PlanViolation

VOCAB = list(range(10, 74))  # never a special id (< 10)


@dataclass(frozen=True)
class NullModel:
    """`vocab`: the ids it ever produces (at most 64, one digest byte each); `context`: how
    many trailing tokens its logits depend on (None: the whole sequence)."""

    vocab: tuple[int, ...] = tuple(VOCAB)
    context: int | None = None

    def logprobs(self, token_ids: Sequence[int]) -> list[tuple[int, float]]:
        """log_softmax of digest-derived logits, as (token id, float32 logprob), best first."""
        seen = token_ids[-self.context:] if self.context else token_ids
        digest = hashlib.blake2b(struct.pack(f"<{len(seen)}I", *seen),
                                 digest_size=len(self.vocab)).digest()
        logits = [b / 16.0 for b in digest]
        top = max(logits)
        log_norm = top + math.log(sum(math.exp(x - top) for x in logits))
        pairs = [(t, struct.unpack("f", struct.pack("f", x - log_norm))[0])
                 for t, x in zip(self.vocab, logits, strict=True)]
        return sorted(pairs, key=lambda p: (-p[1], p[0]))

    def sample(self, token_ids: Sequence[int], spec: SamplingSpec,
               banned: frozenset[int] = frozenset()) -> int:
        """Greedy: the best token not banned. Sampled: a digest of (seed, sequence), so seeded
        is reproducible and sequences with different seeds part ways."""
        if spec.temperature == 0:
            return next(t for t, _ in self.logprobs(token_ids) if t not in banned)
        if self.context:
            key = f"{spec.seed}:{len(token_ids)}:{list(token_ids[-self.context:])}".encode()
        else:
            key = f"{spec.seed}:{list(token_ids)}".encode()
        allowed = [t for t in self.vocab if t not in banned]
        return allowed[int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
                       % len(allowed)]

    def token_logprob(self, token_ids: Sequence[int], token_id: int) -> tuple[float, int]:
        """(logprob, rank) of `token_id` after `token_ids`; a token outside the vocabulary
        has logprob OUTSIDE_LOGPROB and ranks after all of it."""
        pairs = self.logprobs(token_ids)
        own = next((lp for t, lp in pairs if t == token_id), OUTSIDE_LOGPROB)
        return own, 1 + sum(lp > own for _, lp in pairs)

    def banned(self, spec: SamplingSpec, num_output_tokens: int) -> frozenset[int]:
        """The ids min_tokens masks at this output length (the executor's rule)."""
        if spec.min_tokens and num_output_tokens < spec.min_tokens:
            return frozenset(spec.min_tokens_stop_ids)
        return frozenset()

    def continuation(self, prompt: Sequence[int], spec: SamplingSpec, max_tokens: int,
                     stop_ids: frozenset[int], min_tokens: int = 0) -> list[int]:
        """What one sequence generates uninterrupted: until a stop id (once it has min_tokens
        tokens) or max_tokens; the executor masks `spec.min_tokens_stop_ids` before."""
        ids = list(prompt)
        while len(ids) - len(prompt) < max_tokens:
            token = self.sample(ids, spec, self.banned(spec, len(ids) - len(prompt)))
            ids.append(token)
            if token in stop_ids and len(ids) - len(prompt) >= min_tokens:
                break
        return ids[len(prompt):]

    def draft(self, token_ids: Sequence[int], count: int) -> list[int]:
        """A draft model's greedy proposals: the model's own greedy tokens, but wrong at some
        positions (a digest of the position decides), so proposals are accepted in part."""
        ids = list(token_ids)
        for _ in range(count):
            best = self.logprobs(ids)
            wrong = hashlib.blake2b(struct.pack("<I", len(ids)), digest_size=1).digest()[0] % 4
            ids.append(best[1 if wrong == 0 else 0][0])
        return ids[len(token_ids):]


OUTSIDE_LOGPROB = -100.0
DEFAULT_MODEL = NullModel()


def null_logprobs(token_ids: list[int]) -> list[tuple[int, float]]:
    return DEFAULT_MODEL.logprobs(token_ids)


def null_sample(token_ids: list[int], spec: SamplingSpec) -> int:
    return DEFAULT_MODEL.sample(token_ids, spec)


class MirrorViolation(PlanViolation):
    pass


@dataclass
class _Req:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingSpec
    num_prompt_tokens: int


def _prefix_digests(token_ids: Sequence[int]) -> list[int]:
    """digests[p] stands for token_ids[:p + 1] (a running hash: equal prefixes, equal values)."""
    out, h = [], 0
    for t in token_ids:
        h = hash((h, t))
        out.append(h)
    return out


def refusal(spec: SamplingSpec) -> str | None:
    """Why a row may not verify proposals (the executor's SpecVerifier.refusal), or None."""
    if not spec.append_sampled:
        return "proposals need a request whose sampled tokens the executor appends"
    if spec.num_logprobs or spec.sampled_logprob or spec.prompt_logprobs >= 0:
        return "proposals cannot be verified for a request that asks for logprobs"
    if (spec.structured is not None or (spec.min_tokens and spec.min_tokens_stop_ids)
            or spec.repetition_penalty != 1.0 or spec.presence_penalty
            or spec.frequency_penalty or spec.min_p or spec.logit_bias
            or spec.allowed_token_ids or spec.bad_words):
        return "proposals cannot be verified for a request with logits processors"
    return None


@dataclass
class KVMirror:
    block_size: int
    model: NullModel = DEFAULT_MODEL
    num_draft_tokens: int = 0  # Hello.num_draft_tokens: proposals after each step
    # The executor's (plan_validation.py): no step computes past it, no request holds more than
    # max_model_len + 1 tokens (the last sampled, never computed) nor more blocks than
    # max_model_len tokens need; the draft model proposes within it.
    max_model_len: int = 1 << 30
    reqs: dict[str, _Req] = field(default_factory=dict)
    slots: dict[tuple[int, int], int] = field(default_factory=dict)  # gpu: prefix digests
    cpu_slots: dict[tuple[int, int], int] = field(default_factory=dict)
    num_copies: int = 0
    num_scheduled_tokens: int = 0
    num_proposed: int = 0  # spec tokens verified
    num_accepted: int = 0
    last_step_id: int | None = None

    def apply(self, plan: StepPlan) -> StepResult:
        if self.last_step_id is not None and plan.step_id != self.last_step_id + 1:
            raise MirrorViolation(f"step {plan.step_id} after step {self.last_step_id}")
        self.last_step_id = plan.step_id
        if plan.reset:
            self.reqs.clear()
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            if self.reqs.pop(req_id, None) is None:
                raise MirrorViolation(f"step {plan.step_id}: dropping unknown {req_id}")
        scheduled: list[tuple[str, int, list[int]]] = []
        for new in plan.new_reqs:  # a held request sent again replaces the executor's copy
            self.reqs[new.req_id] = _Req(list(new.token_ids), list(new.block_ids),
                                         new.num_computed_tokens, new.sampling,
                                         new.num_prompt_tokens)
            scheduled.append((new.req_id, new.num_scheduled_tokens, []))
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
            drafts = list(cached.spec_token_ids)
            if drafts:
                self._check_spec(plan.step_id, cached.req_id, req, cached.num_scheduled_tokens,
                                 drafts)
            scheduled.append((cached.req_id, cached.num_scheduled_tokens, drafts))
        if len({r for r, _, _ in scheduled}) != len(scheduled):
            raise MirrorViolation(f"step {plan.step_id}: a request is scheduled twice")
        self._move(plan.swap_out, self.slots, self.cpu_slots)
        self._move(plan.swap_in, self.cpu_slots, self.slots)
        if len({d for _, d in plan.block_copies}) != len(plan.block_copies):
            raise MirrorViolation(f"step {plan.step_id}: two copies into one block")
        self._move(plan.block_copies, self.slots, self.slots)
        self.num_copies += len(plan.block_copies)
        sampled, logprobs, proposals, sampled_lps, prompt_logprobs = [], [], [], [], []
        for req_id, num_scheduled, drafts in scheduled:
            req = self.reqs[req_id]
            real = len(req.token_ids)
            req.token_ids.extend(drafts)  # computed after the last real token (spec/verifier.py)
            end = req.num_computed_tokens + num_scheduled
            if num_scheduled < 1 or end > len(req.token_ids) \
                    or len(req.block_ids) * self.block_size < end:
                raise MirrorViolation(f"step {plan.step_id}: {req_id} cannot compute "
                                      f"{req.num_computed_tokens}..{end}")
            if end > self.max_model_len or real > self.max_model_len + 1 or \
                    len(req.block_ids) > -(-self.max_model_len // self.block_size):
                raise MirrorViolation(f"step {plan.step_id}: {req_id} computes up to {end} "
                                      f"of {real} tokens in {len(req.block_ids)} blocks: past "
                                      f"max_model_len {self.max_model_len}")
            self._check_prefix(plan.step_id, req_id, req)
            if req.sampling.prompt_logprobs >= 0:
                prompt_logprobs.append(self._prompt_logprobs(req_id, req, end))
            self._write(plan.step_id, req_id, req, end)
            self.num_scheduled_tokens += num_scheduled
            if end < len(req.token_ids):
                continue  # mid-prompt: nothing sampled
            if drafts:
                emitted = self._verify(req, real, drafts)
            else:
                spec = req.sampling
                emitted = [self.model.sample(req.token_ids, spec, self.model.banned(
                    spec, len(req.token_ids) - req.num_prompt_tokens))]
            sampled.append((req_id, emitted))
            if req.sampling.num_logprobs:
                top = self.model.logprobs(req.token_ids)[:req.sampling.num_logprobs]
                logprobs.append((req_id, [t for t, _ in top], [lp for _, lp in top]))
            if req.sampling.sampled_logprob:
                sampled_lps.append((req_id, *self.model.token_logprob(req.token_ids,
                                                                      emitted[0])))
            if req.sampling.append_sampled:
                req.token_ids.extend(emitted)
                if self.num_draft_tokens and refusal(req.sampling) is None:
                    proposals.append((req_id, self._propose(plan.step_id, req_id, req)))
        return StepResult(step_id=plan.step_id, sampled=sampled, execute_time_s=0.0,
                          logprobs=logprobs, sampled_logprobs=sampled_lps,
                          prompt_logprobs=[e for e in prompt_logprobs if e.token_logprobs],
                          proposals=proposals)

    def _prompt_logprobs(self, req_id: str, req: _Req, end: int) -> PromptLogprobs:
        """The computed positions that have a next token held (not the one that samples):
        each next token's logprob and rank, and the top prompt_logprobs, from index
        num_computed + 1 on."""
        start, k = req.num_computed_tokens, req.sampling.prompt_logprobs
        ids = req.token_ids
        lps, ranks, top_ids, top_lps = [], [], [], []
        for p in range(start, min(end, len(ids) - 1)):
            lp, rank = self.model.token_logprob(ids[:p + 1], ids[p + 1])
            top = self.model.logprobs(ids[:p + 1])[:k]
            lps.append(lp)
            ranks.append(rank)
            top_ids.append([t for t, _ in top])
            top_lps.append([v for _, v in top])
        return PromptLogprobs(req_id=req_id, start=start + 1, token_logprobs=lps, ranks=ranks,
                              top_ids=top_ids, top_logprobs=top_lps)

    def _check_spec(self, step_id: int, req_id: str, req: _Req, num_scheduled: int,
                    drafts: list[int]) -> None:
        if (why := refusal(req.sampling)) is not None:
            raise MirrorViolation(f"step {step_id}: {req_id}: {why}")
        if num_scheduled != 1 + len(drafts) or \
                req.num_computed_tokens != len(req.token_ids) - 1:
            raise MirrorViolation(f"step {step_id}: {req_id} verifies {len(drafts)} proposals "
                                  f"in {num_scheduled} tokens from {req.num_computed_tokens} "
                                  f"of {len(req.token_ids)}: not a decode with proposals")

    def _verify(self, req: _Req, real: int, drafts: list[int]) -> list[int]:
        """SpecVerifier.verify and settle: proposals accepted while they equal the model's own
        draws, then the first draw that differs (or one more); the row back to its real tokens
        plus those, computed up to all but the last."""
        del req.token_ids[real:]
        emitted: list[int] = []
        for j in range(len(drafts) + 1):
            draw = self.model.sample(req.token_ids + emitted, req.sampling)
            emitted.append(draw)
            if j == len(drafts) or draw != drafts[j]:
                break
        self.num_proposed += len(drafts)
        self.num_accepted += len(emitted) - 1
        req.num_computed_tokens = real + len(emitted) - 1
        return emitted

    def _propose(self, step_id: int, req_id: str, req: _Req) -> list[int]:
        """executor_svc/spec/draft.py: up to k proposals, as many as the row's blocks and
        max_model_len leave room for; the draft writes its KV at the positions after the last
        real token, which must lie in blocks this request alone holds."""
        num_tokens = len(req.token_ids)
        room = min(len(req.block_ids) * self.block_size, self.max_model_len) - num_tokens + 1
        count = max(0, min(room, self.num_draft_tokens))
        for pos in range(num_tokens, num_tokens + count - 1):
            block_id = req.block_ids[pos // self.block_size]
            if others := [r for r, o in self.reqs.items()
                          if r != req_id and block_id in o.block_ids]:
                raise MirrorViolation(f"step {step_id}: {req_id}'s draft writes lookahead "
                                      f"block {block_id}, shared with {others}")
        return self.model.draft(req.token_ids, count)

    def _move(self, pairs, src: dict, dst: dict) -> None:
        moved = [(b, [src.get((a, offset)) for offset in range(self.block_size)])
                 for a, b in pairs]  # read all before writing: pairs may chain
        for b, values in moved:
            for offset, value in enumerate(values):
                if value is None:
                    dst.pop((b, offset), None)
                else:
                    dst[(b, offset)] = value

    def _slot(self, req: _Req, pos: int) -> tuple[int, int]:
        return req.block_ids[pos // self.block_size], pos % self.block_size

    def _check_prefix(self, step_id: int, req_id: str, req: _Req) -> None:
        digests = _prefix_digests(req.token_ids[:req.num_computed_tokens])
        for pos, digest in enumerate(digests):
            if self.slots.get(self._slot(req, pos)) != digest:
                raise MirrorViolation(f"step {step_id}: {req_id} position {pos} in block "
                                      f"{self._slot(req, pos)[0]} holds another sequence's KV")

    def _write(self, step_id: int, req_id: str, req: _Req, end: int) -> None:
        digests = _prefix_digests(req.token_ids[:end])
        written = {self._slot(req, pos)[0] for pos in range(req.num_computed_tokens, end)}
        for other_id, other in self.reqs.items():
            if other_id != req_id and (shared := written & set(other.block_ids)):
                raise MirrorViolation(f"step {step_id}: {req_id} writes blocks {shared}, "
                                      f"shared with {other_id} (copy-on-write missing)")
        for pos in range(req.num_computed_tokens, end):
            self.slots[self._slot(req, pos)] = digests[pos]
        req.num_computed_tokens = end

    def fail(self, plan: StepPlan):
        raise NotImplementedError("KVMirror simulates no failed steps; use PlanMirror")
