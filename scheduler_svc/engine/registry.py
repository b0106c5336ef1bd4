"""Every accepted request, from `submit` to its last message, independent of any executor.

A `ClientRequest` is one gRPC stream: what the client asked for (`SubmitParams`: prompt ids,
sampling incl. seed, stop ids, n / beam search), its capped `max_tokens`, its place in the FCFS
order, and per sequence what was streamed so far (`SequenceOutput`: token ids, detokenizer
offsets, the text held back for stop strings, usage). The Scheduler's `Request`s are rebuilt from it whenever an executor connects,
so a request survives the loss of the executor that was running it:

    submit --> ClientRequest --admit--> Scheduler Requests --steps--> OutputProcessor --> stream
                   ^                                                            |
                   +---- executor lost: Scheduler dropped, ClientRequest kept --+
                         executor back: re-admitted from prompt + streamed tokens

How each kind resumes (`resume_plan`):
- one sequence: a new Request with prompt = the original prompt and the streamed tokens as its
  output, so the executor recomputes both and samples the next token at the same position; a
  seeded draw depends on (seed, position) only, so the continuation is the same as unbroken,
  and the detokenizer and stop checker carry on from their state, so the text is too.
- n > 1 (parallel sampling): if no sequence streamed anything yet, the group starts over as
  new; otherwise each unfinished sequence i resumes as a plain request `<id>/<i>` with the seed
  of sequence i (sharing prompt blocks through the prefix cache instead of a fork).
- beam search: nothing is streamed before the search ends, so it restarts from the prompt.

Invariant: a ClientRequest is in the registry exactly while its stream is owed a message; it
leaves with its last one (every sequence finished, an abort, or an error).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from scheduler_svc.sched.request import RequestOutput, RequestStatus, SubmitParams
from scheduler_svc.text.detokenizer import IncrementalDetokenizer
from scheduler_svc.text.stop_strings import StopChecker


@dataclass(eq=False)
class SequenceOutput:
    """What one sequence (index) of a stream has sent to the client."""

    index: int
    detokenizer: IncrementalDetokenizer  # holds every token id streamed, and its offsets
    stop: StopChecker  # stop strings: the text held back from the stream, the match
    finish_status: RequestStatus | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    prompt_logprobs_sent: bool = False  # index 0's first message carried them (if asked)
    # Monotonic times of its first and latest messages with token ids (scheduler_svc.engine.metrics).
    first_token_at: float | None = None
    last_token_at: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        """Every token id streamed to the client, in order."""
        return self.detokenizer.token_ids

    @property
    def finished(self) -> bool:
        return self.finish_status is not None


@dataclass(eq=False)
class ClientRequest:
    req_id: str
    params: SubmitParams
    max_tokens: int  # already capped by max_model_len at submit
    arrival: int  # FCFS order, kept across executors
    sequences: list[SequenceOutput]
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    suspended_at: float | None = None  # monotonic time the executor was lost; None = running
    num_resumes: int = 0
    # Monotonic times: the Generate call, and the first plan that ran it (kept over resumes).
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None

    @property
    def is_group(self) -> bool:
        return not self.params.sequence.is_single

    def seq_id(self, index: int) -> str:
        """The scheduler's id of sequence `index` (see sequence_group.py for the forms)."""
        return f"{self.req_id}/{index}" if self.is_group else self.req_id

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.sequences)

    def unfinished(self) -> list[SequenceOutput]:
        return [s for s in self.sequences if not s.finished]

    def put(self, output: RequestOutput) -> None:
        self.queue.put_nowait(output)


class Registry:
    """Client requests by id, in arrival order, and each visible sequence by scheduler id."""

    def __init__(self) -> None:
        self._requests: dict[str, ClientRequest] = {}
        self._sequences: dict[str, tuple[ClientRequest, SequenceOutput]] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[ClientRequest]:
        """Arrival order (dicts keep insertion order; requests are added as they arrive)."""
        return iter(list(self._requests.values()))

    def get(self, req_id: str) -> ClientRequest | None:
        return self._requests.get(req_id)

    def sequence(self, seq_id: str) -> tuple[ClientRequest, SequenceOutput] | None:
        return self._sequences.get(seq_id)

    def clients_of(self, seq_ids: Iterable[str]) -> list[ClientRequest]:
        """The client requests these scheduler sequence ids belong to (ids are "<id>" or
        "<id>/<suffix>", and a client id never contains '/')."""
        found: dict[str, ClientRequest] = {}
        for seq_id in seq_ids:
            client = self._requests.get(seq_id.split("/", 1)[0])
            if client is not None:
                found[client.req_id] = client
        return list(found.values())

    def add(self, client: ClientRequest) -> None:
        assert client.req_id not in self._requests, f"duplicate request id {client.req_id}"
        self._requests[client.req_id] = client
        for seq in client.sequences:
            self._sequences[client.seq_id(seq.index)] = (client, seq)

    def remove(self, client: ClientRequest) -> None:
        if self._requests.get(client.req_id) is client:
            del self._requests[client.req_id]
            for seq in client.sequences:
                self._sequences.pop(client.seq_id(seq.index), None)

    def suspend_all(self, now: float) -> int:
        """The executor is gone: every request waits for the next one from `now`."""
        for client in self._requests.values():
            if client.suspended_at is None:
                client.suspended_at = now
        return len(self._requests)

    def expired(self, now: float, resume_timeout_s: float) -> list[ClientRequest]:
        return [c for c in self._requests.values()
                if c.suspended_at is not None and now - c.suspended_at >= resume_timeout_s]
