"""Between step results and the streams: detokenize, check stop strings, record what was
streamed, emit.

`Scheduler.update` turns a StepResult into `StepOutput`s (new token ids per sequence, token
stops applied, because a finished sequence frees its KV blocks within the same step; vLLM v1
splits it the same way). This class takes them from there, for the sequences a client sees,
one token at a time:

    token id --> the sequence's detokenizer: its token ids are the record a resume starts
                 from (registry.py); its text delta goes on to
             --> the sequence's StopChecker (stop_strings.py): releases what no stop string
                 can still claim; on a match the sequence ends here (STOP, the string), later
                 ids of the step are dropped, and `process` returns its id for the engine to
                 finish it in the Scheduler
             --> RequestOutput on the client's queue (last one with finish status, matched
                 stop and usage); the request leaves the registry with its last message
             --> its latencies (scheduler_svc.engine.metrics): a message with token ids is timed,
                 an ending is counted and logged at INFO

A sequence that ends on a stop token id (EOS, stop_token_ids) keeps the id in its token_ids but
not its text, unless include_stop_str_in_output (vLLM's rule). Hidden sequences (a
parallel-sampling parent, beams) have no SequenceOutput and are skipped. Every ending goes
through here, so a stream gets exactly one last message per sequence (a finish) or one error.
"""

from __future__ import annotations

import time

from scheduler_svc.engine.metrics import RequestMetrics
from scheduler_svc.engine.registry import ClientRequest, Registry, SequenceOutput
from scheduler_svc.sched.request import RequestOutput, RequestStatus, TokenLogprobs
from scheduler_svc.sched.step_results import StepOutput


class OutputProcessor:
    def __init__(self, registry: Registry, metrics: RequestMetrics):
        self.registry = registry
        self.metrics = metrics

    def process(self, outputs: list[StepOutput]) -> list[str]:
        """Emit the outputs; returns the ids of sequences whose text completed a stop string,
        which the Scheduler must still finish (`Scheduler.stop_request`)."""
        stopped_by_text: list[str] = []
        now = time.monotonic()  # one time for the step's messages (vLLM does the same)
        for req, new_token_ids, finished, logprobs in outputs:
            found = self.registry.sequence(req.req_id)
            if found is None:
                continue  # a hidden sequence, or a request already ended
            client, seq = found
            if seq.finished:
                continue  # e.g. a token computed past its stop string (overlap)
            seq.num_cached_tokens = req.num_cached_tokens
            status = req.status if finished else None
            matched = req.matched_stop if status is RequestStatus.FINISHED_STOPPED else None
            prompt_lps = (self._prompt_logprobs(client, seq, req.prompt_logprobs)
                          if client.params.sampling.prompt_logprobs >= 0 else None)
            self._emit(client, seq, new_token_ids, status, matched, logprobs, prompt_lps, now)
            if seq.stop.matched is not None and not finished:
                stopped_by_text.append(req.req_id)
        return stopped_by_text

    @staticmethod
    def _prompt_logprobs(client: ClientRequest, seq: SequenceOutput,
                         recorded: list[TokenLogprobs | None] | None
                         ) -> list[TokenLogprobs] | None:
        """The prompt's logprobs (asked for) if this is index 0's first message: sent once,
        whatever preemptions and resumes recomputed."""
        if seq.index != 0 or seq.prompt_logprobs_sent:
            return None
        seq.prompt_logprobs_sent = True
        num_prompt = len(client.params.prompt_token_ids)
        entries = recorded if recorded is not None else [None] * (num_prompt - 1)
        assert all(e is not None for e in entries), \
            f"{client.req_id}: a prompt position's logprobs were never reported"
        return entries  # type: ignore[return-value]

    def finish(self, client: ClientRequest, seq: SequenceOutput, status: RequestStatus) -> None:
        """End one sequence without new tokens (abort, or a resume that has no room left)."""
        if not seq.finished:
            self._emit(client, seq, [], status)

    def abort(self, client: ClientRequest) -> None:
        now = time.monotonic()
        for seq in client.unfinished():
            self._emit(client, seq, [], RequestStatus.FINISHED_ABORTED, now=now)
        self.registry.remove(client)

    def fail(self, client: ClientRequest, error: Exception) -> None:
        """End the whole stream with a status (the handler raises `error`)."""
        now = time.monotonic()
        for seq in client.unfinished():
            seq.finish_status = RequestStatus.FINISHED_ERROR
            self.metrics.finished(client, seq, RequestStatus.FINISHED_ERROR, now)
        client.put(RequestOutput([], error=error))
        self.registry.remove(client)

    def _emit(self, client: ClientRequest, seq: SequenceOutput, new_token_ids: list[int],
              status: RequestStatus | None, matched: int | str | None = None,
              logprobs: list[TokenLogprobs] | None = None,
              prompt_logprobs: list[TokenLogprobs] | None = None,
              now: float | None = None) -> None:
        """`status` ends the sequence after these ids; with FINISHED_STOPPED, `matched` is the
        stop id that is the last of them (or a beam's stop string). `logprobs`: one per id;
        `now`: the monotonic time of the message (default: now)."""
        now = time.monotonic() if now is None else now
        # A stop id's text is not shown (unless asked for): it is recorded, not decoded.
        hide_last = isinstance(matched, int) and not client.params.include_stop_str_in_output
        decoded = new_token_ids[:-1] if hide_last else new_token_ids
        token_ids, text = [], ""
        for token_id in decoded:
            token_ids.append(token_id)
            text += seq.stop.push(seq.detokenizer.push([token_id]), len(seq.token_ids))
            if seq.stop.matched is not None:
                break  # ids after the one that completed the stop string are dropped
        if seq.stop.matched is None and status is not None:
            undecoded = new_token_ids[len(decoded):]
            token_ids += undecoded
            tail = seq.detokenizer.finish(undecoded)
            if status is RequestStatus.FINISHED_ABORTED:  # shows what it has; no stop sought
                text += seq.stop.flush() + tail
            else:
                text += seq.stop.push(tail, len(seq.token_ids))
        if seq.stop.matched is not None:
            status, matched = RequestStatus.FINISHED_STOPPED, seq.stop.matched
        elif status is not None:
            text += seq.stop.flush()
        if status is not None:
            seq.finish_status = status
        client.put(RequestOutput(
            token_ids=token_ids, text=text, finish_status=status,
            num_prompt_tokens=len(client.params.prompt_token_ids),
            num_output_tokens=len(seq.token_ids), num_cached_tokens=seq.num_cached_tokens,
            index=seq.index,
            matched_stop=matched if status is RequestStatus.FINISHED_STOPPED else None,
            # token_ids is always a prefix of new_token_ids (ids after a stop are dropped)
            logprobs=logprobs[:len(token_ids)] if logprobs is not None else None,
            prompt_logprobs=prompt_logprobs))
        if token_ids:
            self.metrics.tokens(client, seq, now)
        if status is not None:
            self.metrics.finished(client, seq, status, now)
            if client.done:
                self.registry.remove(client)
