"""The one request path every generating RPC takes, whatever its wire format (folio.v1's
Generator, the vLLM worker contract): finish the validated SubmitParams off the event loop,
submit them to the engine, and read the request's outputs until each sequence has ended.

Invariant: a request submitted here is either read to its last message, or aborted in the
engine when its reader stops early (client cancelled or went away, a handler raised), so its
KV blocks are freed at once. Readers must close the `outputs` generator promptly
(`contextlib.aclosing`), which runs that abort.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from scheduler_svc.api.prompts import PromptEncoder
from scheduler_svc.api.structured_output import StructuredValidator
from scheduler_svc.engine.engine import Engine
from scheduler_svc.sched.request import RequestOutput, SubmitParams


async def prepare(params: SubmitParams, prompts: PromptEncoder,
                  structured: StructuredValidator) -> SubmitParams:
    """Tokenize the bad words and compile the structured-output constraint, off the event
    loop; `params` already holds the prompt's token ids."""
    bad_words = await prompts.bad_words(params.bad_words)
    sampling = dataclasses.replace(params.sampling, bad_words=bad_words)
    if (spec := sampling.structured) is not None:
        sampling = dataclasses.replace(sampling, structured=await structured.check(spec))
    return dataclasses.replace(params, sampling=sampling)


async def outputs(engine: Engine, params: SubmitParams,
                  arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
    """Submit `params` and yield its outputs, ending after the last sequence's last message;
    an output carrying an error is raised instead (the engine has dropped the request).
    `arrival_time` (time.monotonic() when the RPC began, so latencies count tokenization as
    vLLM's do) defaults to the moment of submission."""
    stream = engine.submit(params)
    if arrival_time is not None:
        stream.arrival_time = arrival_time
    num_open = params.sequence.n  # sequences (n > 1, beams) whose last message is due
    done = False
    try:
        while not done:
            out = await stream.queue.get()
            if out.error is not None:
                done = True
                raise out.error
            if out.finish_status is not None:
                num_open -= 1
                done = num_open == 0
            yield out
    finally:
        if not done:  # the reader stopped early: free the request's blocks now
            engine.abort(params.req_id)
