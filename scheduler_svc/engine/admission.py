"""From a client's request to the Scheduler's sequences: at submit, and again to resume it on a
newly connected executor (registry.py says how each kind resumes)."""

from __future__ import annotations

from dataclasses import replace

from protos.plan import SamplingSpec
from scheduler_svc.api.inputs import check_beam_fits, check_for_executor
from scheduler_svc.engine.handshake import ExecutorInfo
from scheduler_svc.engine.registry import ClientRequest, Registry, SequenceOutput
from scheduler_svc.errors import DuplicateRequest, FolioError, Overloaded
from scheduler_svc.sched.request import Request, SubmitParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.sequence_group import BeamGroup, ParallelGroup
from scheduler_svc.sched.sequence_params import sequence_seed
from scheduler_svc.text.detokenizer import IncrementalDetokenizer
from scheduler_svc.text.stop_strings import BeamStopStrings, StopChecker
from scheduler_svc.text.tokenizer import Tokenizer

MAX_WAITING_REQUESTS = 65536  # beyond this, new requests get RESOURCE_EXHAUSTED


def submit_request(sched: Scheduler, registry: Registry, params: SubmitParams,
                   info: ExecutorInfo, tokenizer: Tokenizer, arrival: int) -> ClientRequest:
    """A new client request, checked against the executor and queued on `sched` (the caller
    adds it to the registry). Raises a FolioError the client can act on."""
    max_tokens = check_for_executor(params, info.vocab_size, info.max_model_len)
    if params.req_id in registry:
        raise DuplicateRequest(f"request_id {params.req_id!r} is already in use by a "
                               "waiting or running request; pick another or leave it empty")
    if len(sched.queues.waiting) >= MAX_WAITING_REQUESTS:
        raise Overloaded(f"{len(sched.queues.waiting)} requests are already waiting; retry later")
    client = ClientRequest(params.req_id, params, max_tokens, arrival,
                           [new_sequence_output(i, params, tokenizer)
                            for i in range(params.sequence.n)])
    no_room = admit(sched, client, info, tokenizer)
    assert not no_room, "a prompt within max_model_len always has room for one token"
    return client


def new_sequence_output(index: int, params: SubmitParams, tokenizer: Tokenizer
                        ) -> SequenceOutput:
    detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens,
                                         params.spaces_between_special_tokens)
    return SequenceOutput(index, detokenizer,
                          StopChecker(params.stop, params.include_stop_str_in_output,
                                      params.min_tokens))


def beam_stop_strings(params: SubmitParams, tokenizer: Tokenizer) -> BeamStopStrings | None:
    """A beam search's stop-string test, decoding as the request's sequences do."""
    if not params.stop:
        return None
    detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens,
                                         params.spaces_between_special_tokens)
    return BeamStopStrings(detokenizer.decode, params.stop)


def admit(sched: Scheduler, client: ClientRequest, info: ExecutorInfo,
          tokenizer: Tokenizer) -> list[SequenceOutput]:
    """Queue `client`'s unfinished sequences on `sched`, from its prompt plus the tokens each
    has streamed. Returns the sequences that have no room left on this executor (they have
    streamed tokens, and prompt + those reach its max_model_len): the caller ends them with
    LENGTH. A sequence that has streamed nothing always has room: its prompt holds at most
    max_model_len tokens (checked), and every prompt gets at least one token, as with n > 1
    and beam search. Raises InvalidRequest when the request cannot run on this executor."""
    p = client.params
    eos_token_ids = tokenizer.eos_token_ids
    stop_token_ids = frozenset(p.stop_token_ids)
    stops = stop_token_ids | (frozenset() if p.ignore_eos else eos_token_ids)
    # The executor masks every id that would stop the sequence until min_tokens.
    spec = replace(p.sampling, min_tokens_stop_ids=tuple(sorted(stops))) \
        if p.min_tokens and stops else p.sampling

    def new_request(seq_id: str, prompt: list[int], sampling: SamplingSpec, index: int
                    ) -> Request:
        return Request(req_id=seq_id, prompt_token_ids=prompt, sampling=sampling,
                       max_tokens=client.max_tokens, arrival=client.arrival,
                       eos_token_ids=eos_token_ids, stop_token_ids=stop_token_ids,
                       ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, index=index,
                       cache_salt=p.cache_salt)

    if client.num_resumes:  # checked at submit against the executor of that time
        check_for_executor(p, info.vocab_size, info.max_model_len)
    if p.sequence.is_beam_search:
        check_beam_fits(p, client.max_tokens, sched.block_manager)
        # A beam ends on the ids that would stop a sequence.
        sched.add_group(BeamGroup(client.req_id, p.sequence, p.prompt_token_ids,
                                  client.max_tokens, stops, info.vocab_size, new_request,
                                  text_stop=beam_stop_strings(p, tokenizer)))
        return []
    started = any(s.token_ids or s.finished for s in client.sequences)
    if client.is_group and not started:
        sched.add_group(ParallelGroup(client.req_id, p.sequence, p.prompt_token_ids,
                                      spec, new_request))
        return []
    no_room = []
    for seq in client.unfinished():
        num_tokens = len(p.prompt_token_ids) + len(seq.token_ids)
        if seq.token_ids and num_tokens >= info.max_model_len:
            no_room.append(seq)
            continue
        # Prompt logprobs are owed to index 0 until its first message carries them.
        owed = seq.index == 0 and not seq.prompt_logprobs_sent
        sampling = replace(spec, seed=sequence_seed(spec.seed, seq.index),
                           prompt_logprobs=spec.prompt_logprobs if owed else -1)
        req = new_request(client.seq_id(seq.index), list(p.prompt_token_ids), sampling,
                          seq.index)
        if seq.token_ids:
            # A recompute preemption in effect: prompt + streamed tokens are computed again,
            # and usage keeps the prefix-cache hit of the first admission.
            req.output_token_ids = list(seq.token_ids)
            req.num_preemptions = 1
            req.num_cached_tokens = seq.num_cached_tokens
        sched.add_request(req)
    return no_room


def readmit_all(sched: Scheduler, registry: Registry, info: ExecutorInfo,
                tokenizer: Tokenizer
                ) -> tuple[list[tuple[ClientRequest, FolioError]],
                           list[tuple[ClientRequest, SequenceOutput]]]:
    """Queue every unfinished request of `registry` on a new Scheduler, in arrival order.
    Returns (requests that cannot run on this executor, with why; sequences with no room
    left): the caller ends the first with an error and the second with LENGTH."""
    refused, no_room = [], []
    for client in registry:
        if client.suspended_at is not None:
            client.suspended_at = None
            client.num_resumes += 1
        try:
            no_room += [(client, seq) for seq in admit(sched, client, info, tokenizer)]
        except FolioError as e:
            refused.append((client, e))
    return refused, no_room
