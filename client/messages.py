"""Request builders and result types shared by the sync and asyncio clients.

Keeps the mapping from Python arguments to `folio.v1` messages in one place: `None` means
"leave the optional field unset" (the server default), which differs from zero for temperature
(0 is greedy, unset is 1.0).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from protos.folio.v1 import generator_pb2 as pb

FINISH_REASON_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}

Messages = Sequence[tuple[str, str]] | Sequence[dict]  # [(role, content)] or [{"role", "content"}]

# raw: the model's distribution; processed: the one each token was drawn from (vLLM's names
# without the _logprobs suffix).
LOGPROBS_MODES = {"raw": pb.LOGPROBS_MODE_RAW, "processed": pb.LOGPROBS_MODE_PROCESSED}
EARLY_STOPPING = {
    "heuristic": pb.EARLY_STOPPING_HEURISTIC,  # HF early_stopping=False
    "true": pb.EARLY_STOPPING_TRUE,
    "never": pb.EARLY_STOPPING_NEVER,
}


@dataclass
class Completion:
    """One sequence of a Generate stream folded into one value (see `fold`)."""

    request_id: str = ""
    index: int = 0  # which of the n sequences
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: dict[str, int] = field(default_factory=dict)  # prompt/completion/cached tokens
    matched_stop: int | str | None = None  # with "stop": the stop token id or stop string
    # With logprobs / prompt_logprobs asked for: one dict per token (token_logprobs_dict).
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict] | None = None

    def add(self, resp: pb.GenerateResponse) -> None:
        self.request_id = resp.request_id or self.request_id
        self.index = resp.index
        self.token_ids.extend(resp.token_ids)
        if resp.logprobs:
            self.logprobs = (self.logprobs or []) + [token_logprobs_dict(t)
                                                     for t in resp.logprobs]
        if resp.prompt_logprobs:
            self.prompt_logprobs = [token_logprobs_dict(t) for t in resp.prompt_logprobs]
        self.text += resp.text
        if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASON_NAMES[resp.finish_reason]
            which = resp.WhichOneof("matched_stop")
            self.matched_stop = getattr(resp, which) if which else None
            self.usage = {
                "prompt_tokens": resp.usage.prompt_tokens,
                "completion_tokens": resp.usage.completion_tokens,
                "cached_tokens": resp.usage.cached_tokens,
            }

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "index": self.index, "token_ids": self.token_ids,
                "text": self.text, "finish_reason": self.finish_reason,
                "matched_stop": self.matched_stop, "usage": self.usage,
                **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
                **({"prompt_logprobs": self.prompt_logprobs}
                   if self.prompt_logprobs is not None else {})}


def token_logprobs_dict(t: pb.TokenLogprobs) -> dict:
    """{"token_id", "logprob", "rank", "top_logprobs": [{"token_id", "logprob"}, ...]}"""
    return {"token_id": t.token_id, "logprob": t.logprob, "rank": t.rank,
            "top_logprobs": [{"token_id": a.token_id, "logprob": a.logprob}
                             for a in t.top_logprobs]}


class Choices:
    """A Generate stream with n sequences (n > 1 or beam search): one Completion per index."""

    def __init__(self) -> None:
        self._by_index: dict[int, Completion] = {}

    def add(self, resp: pb.GenerateResponse) -> Completion:
        completion = self._by_index.setdefault(resp.index, Completion())
        completion.add(resp)
        return completion

    @property
    def completions(self) -> list[Completion]:
        return [self._by_index[i] for i in sorted(self._by_index)]


def chat_message(messages: Messages, add_generation_prompt: bool | None = None) -> pb.Chat:
    chat = pb.Chat()
    for m in messages:
        role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
        chat.messages.add(role=role, content=content)
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


def sampling_params(
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    max_tokens: int | None = None,
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    n: int | None = None,
    beam_width: int | None = None,
    length_penalty: float | None = None,
    early_stopping: str = "heuristic",
    stop: Iterable[str] | str = (),
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool | None = None,
    spaces_between_special_tokens: bool | None = None,
    min_tokens: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_p: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    allowed_token_ids: Iterable[int] = (),
    bad_words: Iterable[str] = (),
    json_schema: str | dict | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Iterable[str] | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    logprobs_mode: str = "raw",
) -> pb.SamplingParams:
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode is one of {sorted(LOGPROBS_MODES)}, "
                         f"got {logprobs_mode!r}")
    if early_stopping not in EARLY_STOPPING:
        raise ValueError(f"early_stopping is one of {sorted(EARLY_STOPPING)}, "
                         f"got {early_stopping!r}")
    params = pb.SamplingParams(stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                               early_stopping=EARLY_STOPPING[early_stopping],
                               stop=[stop] if isinstance(stop, str) else list(stop),
                               include_stop_str_in_output=include_stop_str_in_output,
                               logit_bias=dict(logit_bias or {}),
                               allowed_token_ids=list(allowed_token_ids),
                               bad_words=list(bad_words),
                               logprobs_mode=LOGPROBS_MODES[logprobs_mode])
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                        ("seed", seed), ("max_tokens", max_tokens), ("n", n),
                        ("beam_width", beam_width), ("length_penalty", length_penalty),
                        ("skip_special_tokens", skip_special_tokens),
                        ("spaces_between_special_tokens", spaces_between_special_tokens),
                        ("min_tokens", min_tokens), ("repetition_penalty", repetition_penalty),
                        ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("min_p", min_p),
                        ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(params, name, value)
    structured = [k for k, v in (("json_schema", json_schema), ("json_object", json_object),
                                 ("regex", regex), ("grammar", grammar), ("choice", choice))
                  if v not in (None, False)]
    if len(structured) > 1:
        raise ValueError(f"structured output takes one constraint, got {', '.join(structured)}")
    if json_schema is not None:  # a dict is sent as its JSON text
        params.json_schema = (json_schema if isinstance(json_schema, str)
                              else json.dumps(json_schema))
    elif json_object:
        params.json_object = True
    elif regex is not None:
        params.regex = regex
    elif grammar is not None:
        params.grammar = grammar
    elif choice is not None:
        params.choice.choices.extend(choice)
    return params


def generate_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Messages | None = None,
    add_generation_prompt: bool | None = None,
    request_id: str = "",
    cache_salt: str = "",
    **sampling,
) -> pb.GenerateRequest:
    """Exactly one of `prompt` (text), `token_ids` or `messages` (chat) is the input;
    `cache_salt` shares prefix-cache blocks only with requests of the same salt."""
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of prompt, token_ids or messages")
    req = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt,
                             sampling=sampling_params(**sampling))
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        req.chat.CopyFrom(chat_message(messages, add_generation_prompt))
    return req


def tokenize_request(text: str | None = None, *, messages: Messages | None = None,
                     add_generation_prompt: bool | None = None) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("pass exactly one of text or messages")
    if text is not None:
        return pb.TokenizeRequest(text=text)
    return pb.TokenizeRequest(chat=chat_message(messages, add_generation_prompt))


def message_to_dict(msg) -> dict:
    """Every field by its proto name, defaults included, ints kept as ints (unlike JSON mapping,
    which turns uint64 into strings)."""
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
