"""Between step results and the streams: detokenize, record what was streamed, emit.

`Scheduler.update` turns a StepResult into `StepOutput`s (new token ids per sequence, token
stops applied, because a finished sequence frees its KV blocks within the same step; vLLM v1
splits it the same way). This class takes them from there, for the sequences a client sees:

    StepOutput(req, new ids, finished) --> the sequence's detokenizer: its token ids are the
                                           record a resume starts from (registry.py), its
                                           text delta goes out
                                       --> RequestOutput on the client's queue (last one with
                                           finish status and usage); the request leaves the
                                           registry with its last message

Hidden sequences (a parallel-sampling parent, beams) have no SequenceOutput and are skipped.
Every ending goes through here, so a stream gets exactly one last message per sequence (a
finish) or one error.
"""

from __future__ import annotations

import structlog

from scheduler_svc.registry import ClientRequest, Registry, SequenceOutput
from scheduler_svc.request import RequestOutput, RequestStatus
from scheduler_svc.scheduler import StepOutput

log = structlog.get_logger("folio.scheduler.engine")


class OutputProcessor:
    def __init__(self, registry: Registry):
        self.registry = registry

    def process(self, outputs: list[StepOutput]) -> None:
        for req, new_token_ids, finished in outputs:
            found = self.registry.sequence(req.req_id)
            if found is None:
                continue  # a hidden sequence, or a request already ended
            client, seq = found
            if seq.finished:
                continue
            seq.num_cached_tokens = req.num_cached_tokens
            self._emit(client, seq, new_token_ids, req.status if finished else None)

    def finish(self, client: ClientRequest, seq: SequenceOutput, status: RequestStatus) -> None:
        """End one sequence without new tokens (abort, or a resume that has no room left)."""
        if not seq.finished:
            self._emit(client, seq, [], status)

    def abort(self, client: ClientRequest) -> None:
        for seq in client.unfinished():
            self._emit(client, seq, [], RequestStatus.FINISHED_ABORTED)
        self.registry.remove(client)

    def fail(self, client: ClientRequest, error: Exception) -> None:
        """End the whole stream with a status (the handler raises `error`)."""
        for seq in client.unfinished():
            seq.finish_status = RequestStatus.FINISHED_ERROR
        client.put(RequestOutput([], error=error))
        self.registry.remove(client)

    def _emit(self, client: ClientRequest, seq: SequenceOutput, new_token_ids: list[int],
              status: RequestStatus | None) -> None:
        text = seq.detokenizer.push(new_token_ids) if new_token_ids else ""
        if status is not None:
            text += seq.detokenizer.flush()
            seq.finish_status = status
        client.put(RequestOutput(
            token_ids=new_token_ids, text=text, finish_status=status,
            num_prompt_tokens=len(client.params.prompt_token_ids),
            num_output_tokens=len(seq.token_ids), num_cached_tokens=seq.num_cached_tokens,
            index=seq.index))
        if status is not None:
            log.debug("sequence finished", req_id=client.req_id, index=seq.index,
                      status=status.value, num_output_tokens=len(seq.token_ids))
            if client.done:
                self.registry.remove(client)
