"""Per-sequence state held by the scheduler, the validated public request, and what a stream
receives (`RequestOutput`). What a client is owed across executor restarts lives in
`registry.py`; a `Request` here lives and dies with one Scheduler (one executor connection).

Lifecycle:

    WAITING --schedule--> RUNNING --update--> FINISHED_STOPPED | FINISHED_LENGTH
       ^                   |  |  ^
       +-preempt:recompute-+  |  +--swap in--+      unfinished --abort--> FINISHED_ABORTED
                              +-preempt:swap-+-> SWAPPED     running --error--> FINISHED_ERROR

Preempted by recompute, a request drops its KV blocks and goes back to the front of the waiting
queue with num_computed_tokens = 0; when rescheduled it recomputes prompt + generated tokens
(less what the prefix cache still holds). Preempted by swap, its blocks move to the CPU pool and
it keeps num_computed_tokens; swapped in, it resumes where it stopped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from protos.plan import SamplingSpec
from scheduler_svc.sched.sequence_params import SequenceParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED)


@dataclass(frozen=True)
class SubmitParams:
    """A validated public request, before the engine checks it against the executor's facts."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    max_tokens: int | None = None  # None = up to max_model_len
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sequence: SequenceParams = SequenceParams()  # n > 1 or beam search: a sequence group
    # Text: stop strings (scheduler_svc.text.stop_strings) and how the detokenizer shows tokens.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # No EOS or stop token ends the output before it has min_tokens tokens (also in
    # sampling.min_tokens, where the executor masks those tokens).
    min_tokens: int = 0
    # Words as the client sent them; `sampling.bad_words` holds their token sequences once
    # the server has tokenized them (inputs.bad_words_token_ids).
    bad_words: tuple[str, ...] = ()
    # Prefix-cache namespace (prefix_cache.py): hits only between requests of the same salt.
    cache_salt: str = ""


class TokenLogprobs(NamedTuple):
    """One token's logprob and rank (1 = most likely), and the top alternatives at its
    position, best first (GenerateResponse.TokenLogprobs)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class RequestOutput:
    """One message for the request's stream. `error` set = the stream ends with a status."""

    token_ids: list[int]
    text: str = ""
    finish_status: RequestStatus | None = None  # set on the last output only
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: Exception | None = None
    index: int = 0  # which of the request's n sequences this output belongs to
    matched_stop: int | str | None = None  # with FINISHED_STOPPED: the stop id or string
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids entry, when asked for
    # Prompt tokens 1.. (the first has no context): on index 0's first message, when asked for
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    max_tokens: int  # generated tokens allowed (already capped by max_model_len)
    arrival: int  # FCFS order: a monotonically increasing counter
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop tokens stop nothing before this many output tokens
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV the executor holds
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0  # by the scheduler, or (resumed) by the loss of an executor
    # Prefix caching: requests share cached blocks only under the same salt
    # (GenerateRequest.cache_salt). `block_keys` holds the keys of the leading full blocks of all_token_ids,
    # extended only when needed (`prefix_cache.request_block_keys`), not at every token.
    cache_salt: str = ""
    block_keys: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    # Sequence groups (scheduler_svc.sched.sequence_group): the group this request serves, if any,
    # and its sequence index; tokens the scheduler chose (beam search) that the executor does
    # not hold yet, sent in the next CachedRequest.new_token_ids.
    group: object | None = None
    index: int = 0
    pending_token_ids: list[int] = field(default_factory=list)
    # Overlapped scheduling: steps in flight that will sample a token for this request, whose
    # ids the scheduler does not know yet. num_tokens counts known tokens only; the next plan
    # schedules from num_tokens + num_placeholders (scheduler.py, "Overlap").
    num_placeholders: int = 0
    # Speculative decoding: the proposals the step in flight verifies (scheduler counts them
    # as computed until its result says how many the executor kept; speculation.py).
    spec_token_ids: list[int] = field(default_factory=list)
    # The executor's copy asks for prompt logprobs: it was sent (as a NewRequest) while they
    # were owed. `sampling` stops asking once they are out, the executor's copy only when sent
    # again, and until then the executor verifies no proposals for it (SpecVerifier.refusal).
    executor_prompt_logprobs: bool = False
    # The executor's draft-model proposals for the next step, with the token count they
    # follow (StepResult.proposals): used only while no token has been added since.
    draft_proposals: tuple[int, list[int]] | None = None
    # Set when it finishes STOPPED: the stop token id (EOS or stop_token_ids, the last output
    # token), or for a beam search's result, the stop string its text completed.
    matched_stop: int | str | None = None
    # While sampling.prompt_logprobs >= 0: entry i - 1 is prompt token i's, filled as the
    # chunks that compute its position report (a recompute overwrites with the same values).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
