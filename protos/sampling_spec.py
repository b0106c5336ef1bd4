"""What the executor needs to sample a request: SamplingSpec (and its structured-output
constraint, StructuredSpec), carried inside NewRequest on the step-plan protocol (protos/plan.py)
and decoded as strictly as the rest of it."""

from __future__ import annotations

from dataclasses import dataclass

from protos.wire import _bool, _float, _int, _list, _nat, _nats, _str

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True, kw_only=True)
class StructuredSpec:
    """A structured-output constraint: the executor compiles it (llguidance) into a matcher per
    request, masks every sampled row with it and advances it with each token it appends.

    `text`: the JSON schema, regex or grammar as the client sent it; for "choice" the JSON list
    of the choices; empty for "json_object". `eos_token_ids`: the ids the matcher allows once the
    output is complete (the scheduler's EOS ids, so the sequence then stops)."""

    kind: str
    text: str
    eos_token_ids: tuple[int, ...] = ()

    def to_wire(self) -> list:
        return [self.kind, self.text, list(self.eos_token_ids)]

    @classmethod
    def from_wire(cls, w: object) -> StructuredSpec:
        kind, text, eos_token_ids = _list(w, 3)
        if _str(kind) not in STRUCTURED_KINDS:
            raise ValueError(f"unknown structured output kind {kind!r:.40}")
        return cls(kind=kind, text=_str(text), eos_token_ids=tuple(_nats(eos_token_ids)))


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """What the executor needs to sample; stop conditions stay in the scheduler.

    The logits processors (``min_tokens`` .. ``bad_words``) are off at their defaults, and a
    request that uses none of them costs the executor nothing extra."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = the executor's global generator
    # Return the top `num_logprobs` (token id, logprob) of each sampled row in StepResult.logprobs;
    # logprobs are log_softmax in fp32 of the model's raw logits (before every processor,
    # temperature, top-k and top-p), or of the processed ones with processed_logprobs.
    num_logprobs: int = 0
    # False: the executor does not append what it samples; the scheduler chooses the next token
    # itself (beam search) and sends it in CachedRequest.new_token_ids.
    append_sampled: bool = True
    # min_tokens_stop_ids (the EOS ids unless ignore_eos, and the stop ids) cannot be sampled
    # while the request has fewer than min_tokens output tokens (NewRequest.num_prompt_tokens
    # says where the output starts).
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0  # over prompt + output tokens; 1 = off
    presence_penalty: float = 0.0  # over output tokens; 0 = off
    frequency_penalty: float = 0.0  # over output tokens; 0 = off
    min_p: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids distinct
    allowed_token_ids: tuple[int, ...] = ()  # empty = every token
    # Token sequences: the last token of one is banned when the others end the output.
    bad_words: tuple[tuple[int, ...], ...] = ()
    # Structured output (None = unconstrained); on the wire as the last field, nil or a list.
    structured: StructuredSpec | None = None
    # Return the sampled token's own logprob and rank in StepResult.sampled_logprobs (same
    # distribution as num_logprobs).
    sampled_logprob: bool = False
    # >= 0: for every computed position that has a next token held (a prompt position), return
    # that token's logprob and rank and the top `prompt_logprobs` alternatives in
    # StepResult.prompt_logprobs. -1 = off. The scheduler sets it only while the prompt's
    # logprobs are still owed to the client, so the positions are prompt positions.
    prompt_logprobs: int = -1
    # num_logprobs and sampled_logprob report the distribution the row was sampled from: after
    # the processors (and the grammar's mask), then for temperature > 0 after temperature,
    # min_p, top-k and top-p (tokens they remove at -inf). Prompt logprobs stay raw.
    processed_logprobs: bool = False

    def to_wire(self) -> list:
        return [self.temperature, self.top_p, self.top_k, self.seed, self.num_logprobs,
                self.append_sampled, self.min_tokens, list(self.min_tokens_stop_ids),
                self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
                self.min_p, [[t, b] for t, b in self.logit_bias], list(self.allowed_token_ids),
                [list(w) for w in self.bad_words],
                None if self.structured is None else self.structured.to_wire(),
                self.sampled_logprob, self.prompt_logprobs, self.processed_logprobs]

    @classmethod
    def from_wire(cls, w: list) -> SamplingSpec:
        _list(w, 19)
        seed = w[3]
        if seed is not None and type(seed) is not int:
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        logit_bias = tuple((_nat(t), _float(b)) for t, b in (_list(p, 2) for p in _list(w[12])))
        if len({t for t, _ in logit_bias}) != len(logit_bias):
            raise ValueError("logit_bias names a token id twice")
        bad_words = tuple(tuple(_nats(word)) for word in _list(w[14]))
        if not all(bad_words):
            raise ValueError("bad_words holds an empty token sequence")
        structured = None if w[15] is None else StructuredSpec.from_wire(w[15])
        if _int(w[17]) < -1:
            raise ValueError(f"prompt_logprobs must be >= -1 (-1 = off), got {w[17]}")
        return cls(temperature=_float(w[0]), top_p=_float(w[1]), top_k=_nat(w[2]), seed=seed,
                   num_logprobs=_nat(w[4]), append_sampled=_bool(w[5]),
                   min_tokens=_nat(w[6]), min_tokens_stop_ids=tuple(_nats(w[7])),
                   repetition_penalty=_float(w[8]), presence_penalty=_float(w[9]),
                   frequency_penalty=_float(w[10]),
                   min_p=_float(w[11]), logit_bias=logit_bias,
                   allowed_token_ids=tuple(_nats(w[13])), bad_words=bad_words,
                   structured=structured,
                   sampled_logprob=_bool(w[16]), prompt_logprobs=w[17],
                   processed_logprobs=_bool(w[18]))
