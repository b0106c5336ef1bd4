"""Public API messages -> validated scheduler inputs. Raises InvalidRequest with a sentence the
client can act on: the allowed range and the value received.

Checks happen where a value enters, against what the code downstream can take:
- `submit_params` checks every field the message alone determines, before the prompt is
  tokenized (the slow part, done by `scheduler_svc.api.prompts`);
- `check_for_executor` and `check_beam_fits` check what needs the connected executor's facts
  (vocab, max_model_len, the KV pool), at `Engine.submit`.
A value that could make the executor fail a step must never get through: a failed step fails
every request in it.

A client's request_id may not contain "/": the scheduler names a request's sequences
`<id>/<i>`, `<id>/prompt` and `<id>/beam<r>.<k>` (scheduler_svc.sched.sequence_group), so a client
id with a "/" could collide with another request's sequences.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from protos.folio.v1 import generator_pb2 as pb
from protos.plan import SamplingSpec
from scheduler_svc.api.structured_output import structured_from_proto
from scheduler_svc.errors import InvalidRequest
from scheduler_svc.sched.beam_search import EarlyStopping
from scheduler_svc.sched.request import SubmitParams
from scheduler_svc.sched.sequence_params import MAX_BEAM_WIDTH, MAX_N, SequenceParams
from scheduler_svc.text.tokenizer import ChatTurn

if TYPE_CHECKING:
    from scheduler_svc.sched.block_manager import BlockManager

MAX_SEED = 2**63 - 1  # seeds travel as msgpack ints and feed the executor's hashed stream
MAX_REQUEST_ID_CHARS = 256  # ids are logged and echoed in every response
# A salt is hashed into the first block's key of every request and kept by each cached block's
# KV event; 256 bytes hold any tenant id or a hex SHA-256 with room to spare.
MAX_CACHE_SALT_BYTES = 256
# Beam search asks the executor for (1 + stop ids) x beam_width logprobs per beam and ranks
# them in Python each step, so the stop list is bounded.
MAX_STOP_TOKEN_IDS = 32
# Every stop string is searched at each token of its sequence (stop_strings.py).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_ROLE_CHARS = 64
# Logits processors: every entry is gathered for the executor each step the request samples.
MAX_LOGIT_BIAS = 1024
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties, OpenAI's range
# logprobs and prompt_logprobs: alternatives per token, as the OpenAI API caps top_logprobs.
MAX_LOGPROBS = 20
EARLY_STOPPING = {
    pb.EARLY_STOPPING_HEURISTIC: EarlyStopping.HEURISTIC,
    pb.EARLY_STOPPING_TRUE: EarlyStopping.TRUE,
    pb.EARLY_STOPPING_NEVER: EarlyStopping.NEVER,
}


def _shown(text: str, limit: int = 40) -> str:
    """A client string quoted for an error message, cut to `limit` characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def check_cache_salt(salt: str) -> None:
    if (num_bytes := len(salt.encode())) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequest(f"cache_salt may have at most {MAX_CACHE_SALT_BYTES} bytes of "
                             f"UTF-8, got {num_bytes}; use a short tenant id or a digest of "
                             f"a longer one")


def check_request_id(req_id: str) -> None:
    if len(req_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id may have at most {MAX_REQUEST_ID_CHARS} characters, "
                             f"got {len(req_id)}")
    if not req_id.isprintable():
        raise InvalidRequest(f"request_id may hold only printable characters (no control "
                             f"characters, line breaks or tabs), got {_shown(req_id)}")
    if "/" in req_id:
        raise InvalidRequest(f"request_id {_shown(req_id)} may not contain '/': it is "
                             "reserved for the ids of a request's sequences; pick another "
                             "request_id or leave it empty")


def sampling_spec(p: pb.SamplingParams) -> SamplingSpec:
    """temperature, top_p, top_k, seed and the logits processors. Proto floats are float32, the
    executor's dtype, so a finite value stays finite there; the executor samples greedily below
    temperature 1e-5 and keeps every token when top_k is at least the vocabulary size. Token
    ids are checked against the vocabulary later (`check_for_executor`); bad words are
    tokenized later (`bad_words_token_ids`), and min_tokens' stop ids filled in at admission."""
    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.HasField("top_p") else 1.0
    top_k = p.top_k if p.HasField("top_k") else 0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequest(f"temperature must be >= 0 and finite (0 = greedy), "
                             f"got {temperature:g}")
    if not (0 < top_p <= 1):  # also refuses NaN
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p:g}")
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {top_k}")
    seed = p.seed if p.HasField("seed") else None
    if seed is not None and seed > MAX_SEED:
        raise InvalidRequest(f"seed must be in [0, {MAX_SEED}], got {seed}")
    repetition = p.repetition_penalty if p.HasField("repetition_penalty") else 1.0
    if not (math.isfinite(repetition) and repetition > 0):
        raise InvalidRequest(f"repetition_penalty must be > 0 and finite (1 = off), "
                             f"got {repetition:g}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:  # also refuses NaN
            raise InvalidRequest(f"{name} must be in [-{MAX_ABS_PENALTY:g}, "
                                 f"{MAX_ABS_PENALTY:g}] (0 = off), got {value:g}")
    if not 0 <= p.min_p <= 1:
        raise InvalidRequest(f"min_p must be in [0, 1] (0 = off), got {p.min_p:g}")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got "
                             f"{len(p.logit_bias)}")
    for token_id, bias in p.logit_bias.items():
        if not -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE:
            raise InvalidRequest(f"logit_bias for token {token_id} must be in "
                                 f"[-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], "
                                 f"got {bias:g}")
    return SamplingSpec(
        temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=seed,
        min_tokens=p.min_tokens, repetition_penalty=float(repetition),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty), min_p=float(p.min_p),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in p.logit_bias.items())),
        allowed_token_ids=tuple(sorted(set(p.allowed_token_ids))), **logprob_fields(p))


def logprob_fields(p: pb.SamplingParams) -> dict:
    """logprobs, prompt_logprobs and logprobs_mode as SamplingSpec fields: logprobs = k asks
    for the sampled token's logprob and rank plus k alternatives (num_logprobs), as vLLM."""
    fields: dict = {}
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name) and getattr(p, name) > MAX_LOGPROBS:
            raise InvalidRequest(f"{name} must be between 0 and {MAX_LOGPROBS} alternatives "
                                 f"per token, got {getattr(p, name)}")
    if p.HasField("logprobs"):
        fields.update(num_logprobs=p.logprobs, sampled_logprob=True)
    if p.HasField("prompt_logprobs"):
        fields.update(prompt_logprobs=p.prompt_logprobs)
    if p.logprobs_mode == pb.LOGPROBS_MODE_PROCESSED:
        fields.update(processed_logprobs=True)
    elif p.logprobs_mode != pb.LOGPROBS_MODE_RAW:
        raise InvalidRequest(f"unknown logprobs_mode value {p.logprobs_mode}; use RAW (0) or "
                             "PROCESSED (1)")
    if fields and p.HasField("beam_width") and p.beam_width > 1:
        raise InvalidRequest("logprobs and prompt_logprobs are not supported with beam search "
                             "(beam_width > 1); leave them unset or use beam_width 1")
    return fields


def check_bad_words(words: list[str]) -> tuple[str, ...]:
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequest(f"bad_words may hold at most {MAX_BAD_WORDS} words, got "
                             f"{len(words)}")
    for i, word in enumerate(words):
        if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            raise InvalidRequest(f"bad_words[{i}] must have 1 to {MAX_BAD_WORD_CHARS} "
                                 f"characters, not all whitespace; got {_shown(word)}")
    return tuple(words)


def bad_words_token_ids(words: tuple[str, ...], encode: Callable[[str], list[int]]
                        ) -> tuple[tuple[int, ...], ...]:
    """vLLM's rule: each word (leading whitespace stripped) is encoded without special tokens
    as is, and again after a space; the spaced variant is kept when it is a different first
    token in as many tokens (the word as a new word mid-text), so both placements are banned."""
    sequences: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        spaced = encode(" " + word.lstrip())
        if plain:
            sequences.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(spaced)
    return tuple(tuple(s) for s in sequences)


def sequence_params(p: pb.SamplingParams) -> SequenceParams:
    """n and beam search. n > 1 with temperature 0 is allowed: n identical greedy sequences
    (cheap, as they share the prompt's blocks), which is what a client asking for it expects.
    Any finite length_penalty is allowed: beam scores follow IEEE float32 where the power
    overflows or underflows (scheduler_svc.sched.beam_search)."""
    n = p.n if p.HasField("n") else 1
    beam_width = p.beam_width if p.HasField("beam_width") else 1
    length_penalty = p.length_penalty if p.HasField("length_penalty") else 1.0
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N} sequences, got {n}")
    if not 1 <= beam_width <= MAX_BEAM_WIDTH:
        raise InvalidRequest(f"beam_width must be between 1 (no beam search) and "
                             f"{MAX_BEAM_WIDTH}, got {beam_width}")
    if beam_width > 1 and n > beam_width:
        raise InvalidRequest(f"beam search returns at most beam_width sequences: n = {n} > "
                             f"beam_width = {beam_width}; raise beam_width or lower n")
    if not math.isfinite(length_penalty):
        raise InvalidRequest(f"length_penalty must be a finite number, got {length_penalty}")
    if p.early_stopping not in EARLY_STOPPING:
        raise InvalidRequest(f"unknown early_stopping value {p.early_stopping}; use "
                             "HEURISTIC (0), TRUE (1) or NEVER (2)")
    return SequenceParams(n=n, beam_width=beam_width, length_penalty=float(length_penalty),
                          early_stopping=EARLY_STOPPING[p.early_stopping])


def submit_params(msg: pb.GenerateRequest) -> SubmitParams:
    """Every field but the prompt, checked. `prompt_token_ids` is left empty: the caller fills
    it in from `scheduler_svc.api.prompts.PromptEncoder` once these cheap checks have passed."""
    p = msg.sampling
    sampling = sampling_spec(p)
    sequence = sequence_params(p)
    # Unset or 0: the rest of the context (capped in check_for_executor).
    max_tokens = p.max_tokens or None
    if max_tokens is not None and p.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({p.min_tokens}) may not exceed max_tokens "
                             f"({max_tokens})")
    bad_words = check_bad_words(list(p.bad_words))
    if sequence.is_beam_search:
        check_no_processors(sampling, bad_words)
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(p.stop_token_ids)}")
    check_stop_strings(p.stop)
    check_request_id(msg.request_id)
    check_cache_salt(msg.cache_salt)
    if (structured := structured_from_proto(p, sequence.is_beam_search)) is not None:
        if p.min_tokens:  # the constraint may end the output sooner: nothing left to draw
            raise InvalidRequest(f"min_tokens ({p.min_tokens}) cannot be combined with "
                                 f"structured output ({structured.kind}); unset one of them")
        sampling = replace(sampling, structured=structured)  # compiled in Generate, off the loop
    if msg.WhichOneof("input") is None:
        raise InvalidRequest("the request has no input; set one of text, token_ids or chat")
    return SubmitParams(
        req_id=msg.request_id or uuid.uuid4().hex, prompt_token_ids=[],
        sampling=sampling, max_tokens=max_tokens,
        stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, sequence=sequence,
        stop=tuple(p.stop), include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=(p.skip_special_tokens if p.HasField("skip_special_tokens")
                             else True),
        spaces_between_special_tokens=(p.spaces_between_special_tokens
                                       if p.HasField("spaces_between_special_tokens")
                                       else True),
        min_tokens=p.min_tokens, bad_words=bad_words, cache_salt=msg.cache_salt)


def check_stop_strings(stop) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop may hold at most {MAX_STOP_STRINGS} strings, "
                             f"got {len(stop)}")
    for i, s in enumerate(stop):
        if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"stop string {i} must have 1 to {MAX_STOP_STRING_CHARS} "
                                 f"characters, got {len(s)}"
                                 + (f": {_shown(s)}" if s else " (an empty string would "
                                    "stop at once; leave it out)"))


def check_no_processors(s: SamplingSpec, bad_words: tuple[str, ...]) -> None:
    """Beam search ranks the raw model logprobs (HF's beam search without logits processors),
    so none of the processors applies; a request setting one is refused, not half-served."""
    used = [name for name, value in (
        ("min_tokens", s.min_tokens), ("repetition_penalty", s.repetition_penalty != 1.0),
        ("presence_penalty", s.presence_penalty), ("frequency_penalty", s.frequency_penalty),
        ("min_p", s.min_p), ("logit_bias", s.logit_bias),
        ("allowed_token_ids", s.allowed_token_ids), ("bad_words", bad_words)) if value]
    if used:
        raise InvalidRequest(f"beam search (beam_width > 1) does not support "
                             f"{', '.join(used)}; unset them or use beam_width 1")


def chat_turns(chat: pb.Chat, max_model_len: int) -> list[ChatTurn]:
    """The chat's messages, checked: at least one, at most max_model_len (every template
    spends at least a token per turn), each role a short printable name."""
    if not chat.messages:
        raise InvalidRequest("the chat has no messages; send at least one")
    if len(chat.messages) > max_model_len:
        raise InvalidRequest(f"the chat has {len(chat.messages)} messages, more than "
                             f"max_model_len ({max_model_len}) tokens can hold")
    for i, m in enumerate(chat.messages):
        if not (1 <= len(m.role) <= MAX_ROLE_CHARS and m.role.isprintable()):
            raise InvalidRequest(f"chat message {i}: role must be 1 to {MAX_ROLE_CHARS} "
                                 f"printable characters (e.g. 'user'), got {_shown(m.role)}")
    return [ChatTurn(m.role, m.content) for m in chat.messages]


def check_for_executor(params: SubmitParams, vocab_size: int, max_model_len: int) -> int:
    """Check the token ids and prompt length against the executor's model; returns the
    request's max_tokens, capped so that prompt + output fits max_model_len."""
    num_prompt = len(params.prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequest("the prompt is empty; send at least one token")
    s = params.sampling
    if len(s.allowed_token_ids) > vocab_size:  # deduplicated, so only ids past the vocab
        raise InvalidRequest(f"allowed_token_ids holds {len(s.allowed_token_ids)} distinct "
                             f"ids, more than the model's vocabulary of {vocab_size}")
    for name, ids in (("prompt", params.prompt_token_ids), ("stop", params.stop_token_ids),
                      ("logit_bias", [t for t, _ in s.logit_bias]),
                      ("allowed_token_ids", s.allowed_token_ids),
                      ("bad_words", [t for word in s.bad_words for t in word])):
        if (bad := next((t for t in ids if t >= vocab_size), None)) is not None:
            raise InvalidRequest(f"{name} token id {bad} is out of range: the model's "
                                 f"vocabulary has {vocab_size} tokens "
                                 f"(ids 0..{vocab_size - 1})")
    if num_prompt > max_model_len:
        raise InvalidRequest(prompt_too_long(num_prompt, max_model_len))
    num_top = max(params.sampling.num_logprobs, params.sampling.prompt_logprobs)
    if num_top > vocab_size:
        raise InvalidRequest(f"logprobs and prompt_logprobs may ask for at most the model's "
                             f"{vocab_size} tokens, got {num_top}")
    # At least one token is always generated, even for a prompt of max_model_len tokens.
    max_tokens = max(1, max_model_len - num_prompt)
    if params.max_tokens is not None:
        max_tokens = min(max_tokens, params.max_tokens)
    return max_tokens


def prompt_too_long(num_tokens: int, max_model_len: int) -> str:
    return (f"prompt has {num_tokens} tokens but max_model_len is {max_model_len}; shorten "
            "the prompt")


def check_beam_fits(params: SubmitParams, max_tokens: int, bm: BlockManager) -> None:
    """Beams wait for each other, so a search must fit the KV pool on its own: the prompt
    once, plus for each beam the KV of its generated tokens (all but the last, whose KV is
    never computed) and one copied block at most. With max_tokens 1 (a prompt of
    max_model_len tokens) no beam writes anything past the prompt."""
    width = params.sequence.beam_width
    num_written = max_tokens - 1
    need = bm.num_groups * (bm.blocks_for(len(params.prompt_token_ids)) + (
        width * (bm.blocks_for(num_written) + 1) if num_written else 0))
    if need > bm.num_blocks:
        raise InvalidRequest(f"beam search with beam_width {width} and max_tokens "
                             f"{max_tokens} may need {need} KV blocks, but the pool has "
                             f"{bm.num_blocks}; lower beam_width or max_tokens")
