"""The vLLM worker contract's messages (`vllm.grpc.engine`, from the smg-grpc-proto package)
<-> Folio's: a contract GenerateRequest becomes a folio.v1 GenerateRequest, which then takes
Folio's own checks (`inputs.submit_params`) and request path; Folio's outputs become the
contract's chunks and completes.

Mapping (vLLM's servicer reads the same fields the same way; proto3 zero = unset where the
contract has no presence):

    contract field                     folio.v1 SamplingParams
    temperature (optional)             temperature (unset: 1.0)
    top_p (0 = unset)                  top_p
    top_k (0 = off)                    top_k, capped at int32 max (>= vocab keeps every token)
    min_p, frequency/presence_penalty  same fields
    repetition_penalty (0 = unset)     repetition_penalty
    max_tokens (optional, >= 1)        max_tokens (unset: the rest of the context)
    min_tokens, stop, stop_token_ids,  same fields
    ignore_eos, include_stop_str_in_output, skip_special_tokens,
    spaces_between_special_tokens
    n (0 = 1)                          n
    logprobs, prompt_logprobs          same (0..20 alternatives; -1 "all" is refused)
    seed (int32)                       seed (negative refused)
    logit_bias                         logit_bias (negative ids refused)
    json_schema / regex / grammar /    the structured_output oneof
    json_object / choice
    truncate_prompt_tokens             the prompt's last k tokens (-1: max_model_len)
    grammar_from_first_token           nothing to do: Folio's constraints always start at
                                       the first generated token

Refused with UNIMPLEMENTED (`NotSupported`): structural_tag, multimodal inputs, media
references, KV-transfer parameters (disaggregated prefill), data_parallel_rank other than 0.
"""

from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2 as vpb

from protos.folio.v1 import generator_pb2 as pb
from scheduler_svc.errors import InvalidRequest, NotSupported
from scheduler_svc.sched.request import RequestOutput, TokenLogprobs

MAX_TOP_K = 2**31 - 1  # folio.v1's top_k is an int32; any k >= the vocabulary is "off"
STRUCTURED = ("json_schema", "regex", "grammar", "json_object")


def folio_request(req: vpb.GenerateRequest) -> pb.GenerateRequest:
    """The contract's request as a folio.v1 GenerateRequest (prompt not yet truncated; see
    `truncate_prompt_tokens`). Raises for what Folio cannot do."""
    check_unsupported(req)
    msg = pb.GenerateRequest(request_id=req.request_id,
                             sampling=folio_sampling(req.sampling_params))
    match req.WhichOneof("input"):
        case "tokenized":
            msg.token_ids.ids.extend(req.tokenized.input_ids)
        case "text":
            msg.text = req.text
        case _:
            raise InvalidRequest("the request has no input; set tokenized.input_ids (or text)")
    return msg


def check_unsupported(req: vpb.GenerateRequest) -> None:
    if req.HasField("mm_inputs") or req.extra_mm_inputs or req.HasField("media_refs"):
        raise NotSupported("multimodal inputs are not supported: Folio serves text-only "
                           "models; send tokenized text")
    if req.HasField("kv_transfer_params") or req.HasField("kv_transfer_params_json"):
        raise NotSupported("KV transfer (disaggregated prefill/decode) is not supported by "
                           "Folio; leave kv_transfer_params unset")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise InvalidRequest(f"data_parallel_rank {req.data_parallel_rank} does not exist: "
                             "this worker has one rank (0); leave it unset")


def folio_sampling(p: vpb.SamplingParams) -> pb.SamplingParams:
    s = pb.SamplingParams(
        min_p=p.min_p, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, min_tokens=p.min_tokens, stop=p.stop,
        stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens)
    if p.HasField("temperature"):
        s.temperature = p.temperature
    if p.top_p != 0:
        s.top_p = p.top_p
    if p.top_k:
        s.top_k = min(p.top_k, MAX_TOP_K)
    if p.repetition_penalty != 0:
        s.repetition_penalty = p.repetition_penalty
    if p.HasField("max_tokens"):
        if p.max_tokens == 0:
            raise InvalidRequest("max_tokens must be at least 1, got 0; leave it unset for "
                                 "the rest of the context")
        s.max_tokens = p.max_tokens
    if p.n:
        s.n = p.n
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name):
            value = getattr(p, name)
            if value < 0:
                raise InvalidRequest(f"{name} must be between 0 and 20 alternatives per "
                                     f"token, got {value}" + (" (all of the vocabulary is not "
                                                               "supported)" if value == -1
                                                               else ""))
            setattr(s, name, value)
    if p.HasField("seed"):
        if p.seed < 0:
            raise InvalidRequest(f"seed must be >= 0, got {p.seed}")
        s.seed = p.seed
    for token_id, bias in p.logit_bias.items():
        if token_id < 0:
            raise InvalidRequest(f"logit_bias has a negative token id {token_id}")
        s.logit_bias[token_id] = bias
    constraint = p.WhichOneof("constraint")
    if constraint in STRUCTURED:
        setattr(s, constraint, getattr(p, constraint))
    elif constraint == "choice":
        s.choice.choices.extend(p.choice.choices)
    elif constraint == "structural_tag":
        raise NotSupported("structural_tag constraints are not supported by Folio; use "
                           "json_schema, regex, grammar, json_object or choice")
    if p.HasField("truncate_prompt_tokens"):
        truncate_to(p, 1)  # checked now, applied to the prompt's ids later
    return s


def truncate_to(p: vpb.SamplingParams, max_model_len: int) -> int | None:
    """How many of the prompt's last tokens to keep, or None to keep it whole."""
    if not p.HasField("truncate_prompt_tokens"):
        return None
    k = p.truncate_prompt_tokens
    if k == -1:
        return max_model_len
    if k < 1:
        raise InvalidRequest(f"truncate_prompt_tokens must be >= 1 (keep that many of the "
                             f"prompt's last tokens) or -1 (max_model_len), got {k}")
    return k


# ---- outputs ---------------------------------------------------------------------------------

def output_logprobs(entries: list[TokenLogprobs], with_top: bool) -> vpb.OutputLogProbs:
    out = vpb.OutputLogProbs()
    for e in entries:
        out.token_ids.append(e.token_id)
        out.token_logprobs.append(e.logprob)
        if with_top:
            out.top_logprobs.add(token_ids=e.top_ids, values=e.top_logprobs)
    return out


def input_logprobs(prompt_ids: list[int], entries: list[TokenLogprobs],
                   with_top: bool) -> vpb.InputLogProbs:
    """Every prompt token; the first has no logprob (no context) and empty alternatives."""
    out = vpb.InputLogProbs(token_ids=prompt_ids)
    out.token_logprobs.add()
    if with_top:
        out.top_logprobs.add()
    for e in entries:
        out.token_logprobs.add(value=e.logprob)
        if with_top:
            out.top_logprobs.add(token_ids=e.top_ids, values=e.top_logprobs)
    return out


def complete(out: RequestOutput, output_ids: list[int]) -> vpb.GenerateComplete:
    """The contract's last message of one sequence: all its output ids, counts, and what
    stopped it (finish_reason "stop" | "length" | "abort", Folio's RequestStatus values)."""
    done = vpb.GenerateComplete(
        output_ids=output_ids, finish_reason=out.finish_status.value,
        prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
        cached_tokens=out.num_cached_tokens, index=out.index)
    if isinstance(out.matched_stop, str):
        done.matched_stop_str = out.matched_stop
    elif out.matched_stop is not None:
        done.matched_token_id = out.matched_stop
    return done
