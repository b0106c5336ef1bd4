"""Scheduler <-> executor messages: the step-plan protocol.

Every message is a frozen dataclass with a one-byte-ish type tag. On the wire a message is the
msgpack encoding of ``[tag, field, field, ...]``: plain ints, floats, strings and lists, in the
order the dataclass declares them. No pickle, no tensors, no class names on the wire.

Conversation (scheduler binds a ZeroMQ ROUTER, each executor connects a DEALER):

    executor                         scheduler
       | -- Hello(version, facts) -->   |   facts: KV blocks that fit, block size, model
       | <-- Welcome | Reject ------    |   Reject carries a reason; the executor exits
       | <-- StepPlan(step 0) --------  |
       | -- StepResult(step 0) ------>  |   sampled ids per request that finished its prompt
       | <-- StepPlan(step 1) --------  |   sent while step 0 runs (overlapped scheduling):
       | -- StepResult(step 1) ------>  |   at most two plans in flight, run in order
       | <-- Shutdown ----------------  |

A StepPlan is a diff against what the executor already holds:
- ``new_reqs``: requests the executor has not seen (or must forget and rebuild, after a
  recompute preemption): all token ids known so far and how many of them are the prompt,
  sampling params (with the logits processors) and the block table.
- ``cached_reqs``: requests it holds: only the blocks appended this step and how many tokens to
  compute. The executor appends each token it samples to its own copy of the request, so a
  decode step sends no token ids at all.
- ``finished_req_ids`` / ``preempted_req_ids``: drop these requests' state (their blocks now
  belong to the scheduler again).
- ``block_copies``, ``swap_out``, ``swap_in``, ``offload_out``, ``offload_in``: (src, dst) block
  pairs the executor performs before the forward pass (copy-on-write, swapping between the GPU
  and the CPU swap pool, and copies to and from the prefix cache's host tier), in this order:
  offload_out, swap_out, swap_in, offload_in, block_copies. Every device read (offload_out,
  swap_out) comes before every device write (swap_in, offload_in, block_copies, the forward
  pass), so the scheduler may hand a block it copies out to a new owner in the same plan.

Decoding is strict: every field's type is checked (``from_wire`` raises TypeError or
ValueError, which the codec turns into ``channel.ProtocolError``), so a malformed message is
refused whole and never reaches the code that acts on it.

Invariant: for every scheduled request, num_computed_tokens + num_scheduled_tokens <= the number
of tokens the executor holds for it; the executor samples a token exactly when that sum equals
the number of tokens it holds (prompt fully computed, or a decode step). The executor runs plans
strictly in the order sent, and counts its holdings after the previous plan (including the
token it appended there), so a plan may be sent before the previous plan's result arrives.
When a step fails (ExecutorError), the executor also skips the failed requests in the one plan
that may already be queued behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import ClassVar, NamedTuple

from protos.sampling_spec import SamplingSpec
from protos.wire import (
    _bool,
    _float,
    _floats,
    _int,
    _list,
    _nat,
    _nats,
    _only,
    _pairs,
    _str,
    _strs,
)

PROTOCOL_VERSION = 14


@dataclass(frozen=True, kw_only=True)
class NewRequest:
    req_id: str
    token_ids: list[int]  # prompt, plus generated tokens when resuming after preemption
    sampling: SamplingSpec
    block_ids: list[int]  # the whole block table so far
    num_computed_tokens: int  # tokens whose KV is already in the blocks (prefix cache hits)
    num_scheduled_tokens: int  # tokens to compute this step, starting at num_computed_tokens
    # token_ids[:num_prompt_tokens] is the prompt, the rest were generated (a resume): the
    # penalties and min_tokens count output tokens from there. Left out: all of token_ids.
    num_prompt_tokens: int = -1

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            object.__setattr__(self, "num_prompt_tokens", len(self.token_ids))

    def to_wire(self) -> list:
        return [self.req_id, self.token_ids, self.sampling.to_wire(), self.block_ids,
                self.num_computed_tokens, self.num_scheduled_tokens, self.num_prompt_tokens]

    @classmethod
    def from_wire(cls, w: list) -> NewRequest:
        _list(w, 7)
        token_ids = _nats(w[1])
        num_prompt_tokens = _nat(w[6])
        if num_prompt_tokens > len(token_ids):
            raise ValueError(f"num_prompt_tokens {num_prompt_tokens} exceeds the "
                             f"{len(token_ids)} token ids sent")
        return cls(req_id=_str(w[0]), token_ids=token_ids, sampling=SamplingSpec.from_wire(w[2]),
                   block_ids=_nats(w[3]),
                   num_computed_tokens=_nat(w[4]), num_scheduled_tokens=_nat(w[5]),
                   num_prompt_tokens=num_prompt_tokens)


class CachedRequest(NamedTuple):
    """A request the executor holds, scheduled again. A NamedTuple (immutable, like the
    dataclasses here): a plan holds one per running request, and on the wire a plan carries
    them as columns (`StepPlan`), from which the executor builds them with ``tuple.__new__``."""

    req_id: str
    new_block_ids: list[int]  # appended to the executor's block table for this request
    num_computed_tokens: int  # the scheduler's count, checked by the executor
    num_scheduled_tokens: int
    # Tokens the scheduler appends to the executor's copy before this step (only for requests
    # with SamplingSpec.append_sampled False, e.g. a beam's chosen token). The default list is
    # shared, like every list a plan holds it is only ever read.
    new_token_ids: list[int] = []  # noqa: RUF012
    # Speculative decoding: proposed next tokens, computed after the last real token in the
    # same step (num_scheduled_tokens = 1 + len). The executor verifies them and reports the
    # accepted ones plus one more token (1..len + 1 in StepResult.sampled); its computed count
    # then covers only the tokens it kept. Only for append_sampled requests.
    spec_token_ids: list[int] = []  # noqa: RUF012


_NUM_CACHED_COLUMNS = len(CachedRequest._fields)


def _cached_to_wire(cached_reqs: list[CachedRequest]) -> list:
    """Columns: [req_ids, new_block_ids lists, num_computed, num_scheduled, new_token_ids
    lists, spec_token_ids lists]; msgpack packs zip's tuples as arrays."""
    return list(zip(*cached_reqs, strict=True)) if cached_reqs else [[]] * _NUM_CACHED_COLUMNS


def _cached_from_wire(w: object) -> list[CachedRequest]:
    # Checked column by column with C-level loops: one entry per running request.
    req_ids, block_ids, computed, scheduled, token_ids, spec_ids = _list(w, _NUM_CACHED_COLUMNS)
    n = len(_list(req_ids))
    for col in (block_ids, computed, scheduled, token_ids, spec_ids):
        if type(col) is not list or len(col) != n:
            raise ValueError(f"cached requests: columns of {n} entries expected")
    if not _only(req_ids, str):
        raise TypeError("cached requests: request ids must be strings")
    if not (_only(computed, int) and _only(scheduled, int)) or (n and min(*computed, *scheduled) < 0):
        raise TypeError("cached requests: token counts must be ints >= 0")
    for col in (block_ids, token_ids, spec_ids):
        if not _only(col, list):
            raise TypeError("cached requests: block and token ids must be lists")
        for ids in filter(None, col):
            _nats(ids)
    # tuple.__new__ straight from the columns (zip yields exactly the six fields).
    return list(map(tuple.__new__, repeat(CachedRequest, n),
                    zip(req_ids, block_ids, computed, scheduled, token_ids, spec_ids,
                        strict=True)))


class PromptLogprobs(NamedTuple):
    """Logprobs of consecutive prompt tokens ``start .. start + len(token_logprobs) - 1`` of one
    request, each given the tokens before it (so start >= 1), computed in one step."""

    req_id: str
    start: int  # index of the first prompt token covered
    token_logprobs: list[float]  # [m] each token's own logprob
    ranks: list[int]  # [m] 1 + the number of tokens strictly more likely
    top_ids: list[list[int]]  # [m][k] the k most likely tokens at each position, best first
    top_logprobs: list[list[float]]  # [m][k] their logprobs


def _prompt_logprobs_from_wire(w: object) -> list[PromptLogprobs]:
    out = []
    for entry in _list(w):
        req_id, start, lps, ranks, top_ids, top_lps = _list(entry, 6)
        lps, ranks = _floats(lps), _nats(ranks)
        top_ids = [_nats(ids) for ids in _list(top_ids)]
        top_lps = [_floats(x) for x in _list(top_lps)]
        m = len(lps)
        if not (len(ranks) == len(top_ids) == len(top_lps) == m):
            raise ValueError("prompt logprobs: as many ranks and top lists as positions")
        if any(len(a) != len(b) for a, b in zip(top_ids, top_lps, strict=True)):
            raise ValueError("prompt logprobs: as many top ids as top values")
        if _nat(start) < 1 or (m and min(ranks) < 1):
            raise ValueError("prompt logprobs: start and ranks must be >= 1")
        out.append(PromptLogprobs(req_id=_str(req_id), start=start, token_logprobs=lps,
                                  ranks=ranks, top_ids=top_ids, top_logprobs=top_lps))
    return out


@dataclass(frozen=True, kw_only=True)
class Hello:
    """Executor -> scheduler, first message after connecting."""

    TAG: ClassVar[int] = 1
    protocol_version: int
    executor_id: str
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int  # GPU (or CPU-backend) KV pool, in blocks
    num_swap_blocks: int  # CPU swap pool, in blocks (0 = no swap)
    dtype: str
    device: str
    random_weights: bool = False
    tensor_parallel_size: int = 1  # ranks behind this executor (KV blocks: the minimum of theirs)
    # Speculative decoding with a draft model: proposals it makes per request per step
    # (StepResult.proposals); 0 = no draft model.
    num_draft_tokens: int = 0
    # The KV groups of the model's layers (executor_svc/kv/groups.py): per group its sliding
    # window, 0 = full attention. Block tables hold one block per group per position,
    # interleaved (scheduler_svc/sched/block_manager.py).
    kv_windows: list[int] = field(default_factory=lambda: [0])
    # What the KV cache stores (--kv-cache-dtype): the model's dtype, "fp8_e4m3" or "int8";
    # "" from a test's Hello means the model's.
    kv_cache_dtype: str = ""
    # The prefix cache's host tier (--kv-offloading-size), in blocks (0 = none).
    num_host_blocks: int = 0

    def to_wire(self) -> list:
        return [self.TAG, self.protocol_version, self.executor_id, self.model_name,
                self.architecture, self.vocab_size, self.max_model_len, self.block_size,
                self.num_kv_blocks, self.num_swap_blocks, self.dtype, self.device,
                self.random_weights, self.tensor_parallel_size, self.num_draft_tokens,
                self.kv_windows, self.kv_cache_dtype, self.num_host_blocks]

    @classmethod
    def from_wire(cls, w: list) -> Hello:
        _list(w, 18)
        kv_windows = _nats(w[15])
        if not kv_windows:
            raise TypeError("kv_windows must name at least one KV group")
        return cls(protocol_version=_int(w[1]), executor_id=_str(w[2]), model_name=_str(w[3]),
                   architecture=_str(w[4]), vocab_size=_nat(w[5]), max_model_len=_nat(w[6]),
                   block_size=_nat(w[7]), num_kv_blocks=_nat(w[8]), num_swap_blocks=_nat(w[9]),
                   dtype=_str(w[10]), device=_str(w[11]), random_weights=_bool(w[12]),
                   tensor_parallel_size=_nat(w[13]), num_draft_tokens=_nat(w[14]),
                   kv_windows=kv_windows, kv_cache_dtype=_str(w[16]),
                   num_host_blocks=_nat(w[17]))


@dataclass(frozen=True, kw_only=True)
class Welcome:
    """Scheduler -> executor: handshake accepted."""

    TAG: ClassVar[int] = 2
    protocol_version: int

    def to_wire(self) -> list:
        return [self.TAG, self.protocol_version]

    @classmethod
    def from_wire(cls, w: list) -> Welcome:
        _list(w, 2)
        return cls(protocol_version=_int(w[1]))


@dataclass(frozen=True, kw_only=True)
class Reject:
    """Scheduler -> executor: handshake refused; `reason` is a sentence for the operator.

    retry=False: the executor cannot serve this scheduler (version, model); it exits.
    retry=True: not now (another executor is connected, or the scheduler does not know this
    connection): the executor keeps sending Hello, and drops any state it holds."""

    TAG: ClassVar[int] = 3
    reason: str
    retry: bool = False

    def to_wire(self) -> list:
        return [self.TAG, self.reason, self.retry]

    @classmethod
    def from_wire(cls, w: list) -> Reject:
        _list(w, 3)
        return cls(reason=_str(w[1]), retry=_bool(w[2]))


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    TAG: ClassVar[int] = 4
    step_id: int
    new_reqs: list[NewRequest] = field(default_factory=list)
    cached_reqs: list[CachedRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src gpu, dst gpu)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, gpu block)
    # The prefix cache's host tier: blocks written through to it, and hits copied back.
    offload_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu block, host slot)
    offload_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, gpu block)
    # The prefix-cache key (hex) of each offload_out block, in order: what the executor
    # records beside the slot in a shared tier file, so that a tier read back after a crash
    # is checked against the keys the scheduler expects (protos/kv_tier_file.py).
    offload_keys: list[str] = field(default_factory=list)

    def __post_init__(self):
        if len(self.offload_keys) != len(self.offload_out):
            raise ValueError(f"{len(self.offload_keys)} offload keys for "
                             f"{len(self.offload_out)} offloaded blocks")
        if any(not 0 < len(k) <= 80 or len(k) % 2 for k in self.offload_keys):
            raise ValueError("an offload key is not the hex of a prefix-cache key")
    # Drop every request the executor holds before applying this plan: the scheduler rebuilt
    # its state (after an internal error) and re-sends what still runs as new requests.
    reset: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return (sum(r.num_scheduled_tokens for r in self.new_reqs)
                + sum(r.num_scheduled_tokens for r in self.cached_reqs))

    def to_wire(self) -> list:
        return [self.TAG, self.step_id,
                [r.to_wire() for r in self.new_reqs],
                _cached_to_wire(self.cached_reqs),
                self.finished_req_ids, self.preempted_req_ids,
                [list(p) for p in self.block_copies],
                [list(p) for p in self.swap_out],
                [list(p) for p in self.swap_in], self.reset,
                [list(p) for p in self.offload_out],
                [list(p) for p in self.offload_in], self.offload_keys]

    @classmethod
    def from_wire(cls, w: list) -> StepPlan:
        _list(w, 13)
        return cls(
            step_id=_nat(w[1]),
            new_reqs=[NewRequest.from_wire(r) for r in _list(w[2])],
            cached_reqs=_cached_from_wire(w[3]),
            finished_req_ids=_strs(w[4]),
            preempted_req_ids=_strs(w[5]),
            block_copies=_pairs(w[6]),
            swap_out=_pairs(w[7]),
            swap_in=_pairs(w[8]),
            reset=_bool(w[9]),
            offload_out=_pairs(w[10]),
            offload_in=_pairs(w[11]),
            offload_keys=_strs(w[12]),
        )


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """Executor -> scheduler: the tokens sampled in step `step_id`.

    `sampled` holds (req_id, token_ids) for each request that sampled this step (one id, or
    with speculative proposals the accepted ones and one more). Requests in the middle of a
    chunked prefill are absent. `logprobs` holds (req_id, top token ids, their logprobs), best
    first, for each sampled request whose SamplingSpec.num_logprobs > 0. `sampled_logprobs`
    holds (req_id, the sampled token's logprob, its rank) for each sampled request whose
    SamplingSpec.sampled_logprob is set; `prompt_logprobs` one entry per request that computed
    prompt positions with SamplingSpec.prompt_logprobs >= 0.
    """

    TAG: ClassVar[int] = 5
    step_id: int
    sampled: list[tuple[str, list[int]]] = field(default_factory=list)
    execute_time_s: float = 0.0  # executor-side wall time of the step, for stats
    logprobs: list[tuple[str, list[int], list[float]]] = field(default_factory=list)
    # How long the executor waited for this plan after sending its previous result (0 for
    # the first plan of a connection): the executor's idle time between steps.
    idle_time_s: float = 0.0
    sampled_logprobs: list[tuple[str, float, int]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # The draft model's proposals for each request's next step (Hello.num_draft_tokens > 0):
    # (req_id, token ids), computed after this step's tokens; the scheduler may send them back
    # as CachedRequest.spec_token_ids, trimmed, and only in the very next plan.
    proposals: list[tuple[str, list[int]]] = field(default_factory=list)

    def to_wire(self) -> list:
        # `sampled` as two columns, [req_ids, token id lists]: one entry per sampled request.
        sampled = list(zip(*self.sampled, strict=True)) if self.sampled else [[], []]
        # `sampled_logprobs` as three columns, [req_ids, logprobs, ranks].
        sampled_lps = (list(zip(*self.sampled_logprobs, strict=True)) if self.sampled_logprobs
                       else [[]] * 3)
        return [self.TAG, self.step_id, sampled,
                self.execute_time_s, [[r, ids, lps] for r, ids, lps in self.logprobs],
                self.idle_time_s, sampled_lps, [list(p) for p in self.prompt_logprobs],
                [[r, ids] for r, ids in self.proposals]]

    @classmethod
    def from_wire(cls, w: list) -> StepResult:
        _list(w, 9)
        req_ids, token_ids = _list(w[2], 2)
        if type(token_ids) is not list or len(token_ids) != len(_strs(req_ids)):
            raise ValueError("sampled: as many token id lists as request ids")
        if not _only(token_ids, list):
            raise TypeError("sampled: token ids must be lists")
        flat = [t for ids in token_ids for t in ids]
        if not _only(flat, int) or (flat and min(flat) < 0):
            raise TypeError("sampled: token ids must be ints >= 0")
        sampled = list(zip(req_ids, token_ids, strict=True))  # msgpack made fresh lists
        logprobs = []
        for entry in _list(w[4]):
            req_id, ids, lps = _list(entry, 3)
            ids, lps = _nats(ids), [_float(x) for x in _list(lps)]
            if len(ids) != len(lps):
                raise ValueError("logprobs: as many token ids as values")
            logprobs.append((_str(req_id), ids, lps))
        lp_req_ids, lp_values, lp_ranks = _list(w[6], 3)
        _strs(lp_req_ids)
        lp_values, lp_ranks = _floats(lp_values), _nats(lp_ranks)
        if not len(lp_req_ids) == len(lp_values) == len(lp_ranks):
            raise ValueError("sampled logprobs: columns of equal length expected")
        if lp_ranks and min(lp_ranks) < 1:
            raise ValueError("sampled logprobs: ranks must be >= 1")
        sampled_logprobs = list(zip(lp_req_ids, lp_values, lp_ranks, strict=True))
        proposals = []
        for entry in _list(w[8]):
            req_id, ids = _list(entry, 2)
            proposals.append((_str(req_id), _nats(ids)))
        return cls(step_id=_nat(w[1]), sampled=sampled, execute_time_s=_float(w[3]),
                   logprobs=logprobs, idle_time_s=_float(w[5]), sampled_logprobs=sampled_logprobs,
                   prompt_logprobs=_prompt_logprobs_from_wire(w[7]), proposals=proposals)


@dataclass(frozen=True, kw_only=True)
class ExecutorError:
    """Executor -> scheduler: step `step_id` failed; the executor keeps no state for it."""

    TAG: ClassVar[int] = 6
    step_id: int
    message: str

    def to_wire(self) -> list:
        return [self.TAG, self.step_id, self.message]

    @classmethod
    def from_wire(cls, w: list) -> ExecutorError:
        _list(w, 3)
        return cls(step_id=_nat(w[1]), message=_str(w[2]))


@dataclass(frozen=True, kw_only=True)
class Shutdown:
    """Scheduler -> executor: exit cleanly."""

    TAG: ClassVar[int] = 7

    def to_wire(self) -> list:
        return [self.TAG]

    @classmethod
    def from_wire(cls, w: list) -> Shutdown:
        _list(w, 1)
        return cls()


Message = Hello | Welcome | Reject | StepPlan | StepResult | ExecutorError | Shutdown
