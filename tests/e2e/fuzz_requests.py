"""The request generator of tests/e2e/api/test_e2e_api_fuzz.py: a hypothesis strategy per
GenerateRequest field, each a pair (values the API's rules allow, values that may break them),
and the composite that draws whole requests from them."""

from __future__ import annotations

from hypothesis import strategies as st

from protos.folio.v1 import generator_pb2 as pb

MAX_SEED = 2**63 - 1
UINT32 = 2**32 - 1
FLT_MAX = 3.4028234663852886e38


VALID_STRUCTURED = [
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'),
    ("json_schema", '{"enum": ["x", 1, null]}'),
    ("json_object", True),
    ("json_object", False),  # asks for nothing
    ("regex", r"[a-c]+\d?"),
    ("grammar", 'root ::= "x" | "y" root'),
    ("grammar", 'start: "a" | "b"'),  # Lark, as llguidance reads it
    ("choice", ["yes", "no", "maybe"]),
    ("choice", ["\u00e9t\u00e9", "\u2603"]),
]
INVALID_STRUCTURED = [
    ("json_schema", '{"type": "nonsense"}'),
    ("json_schema", "[1, 2"),
    ("json_schema", ""),
    ("regex", "(a"),
    ("regex", ""),
    ("grammar", "root ::= missing"),
    ("grammar", "root ::= ("),
    ("choice", []),
    ("choice", ["a", ""]),
    ("choice", ["c"] * 1025),
]


def set_structured(sampling: pb.SamplingParams, value: tuple[str, object]) -> None:
    kind, arg = value
    if kind == "choice":
        sampling.choice.choices.extend(arg)
    else:
        setattr(sampling, kind, arg)


# Each field has values the API allows (extremes included) and wild ones (NaN, inf, negative,
# out of range). A request takes allowed values, then up to two fields get wild ones, so both
# completions and refusals are common.
any_float = st.floats(width=32)  # NaN, +-inf, subnormals, huge, negative zero...
FIELDS = {
    # field: (allowed values, wild values); None = leave the field unset
    "temperature": (st.none() | st.sampled_from([0.0, 0.7, 1.0])
                    | st.floats(0, FLT_MAX, width=32), any_float),
    "top_p": (st.none() | st.floats(0, 1, exclude_min=True, width=32), any_float),
    "top_k": (st.none() | st.integers(0, 50) | st.integers(0, 2**31 - 1),
              st.integers(-(2**31), 2**31 - 1)),
    "seed": (st.none() | st.integers(0, MAX_SEED), st.integers(0, 2**64 - 1)),
    # Always set and small: unset or 0 on random weights runs to max_model_len.
    "max_tokens": (st.integers(1, 3), st.integers(1, 3)),
    "stop_token_ids": (st.lists(st.integers(5, 2047), max_size=32),
                       st.lists(st.integers(0, UINT32), max_size=40)),
    "ignore_eos": (st.booleans(), st.booleans()),
    # Few sequences: n = 128 or 32 beams take seconds per request on a CPU; the limits run
    # once each in test_sequence_limits_complete.
    "n": (st.none() | st.integers(1, 3), st.integers(0, 4) | st.sampled_from([129, UINT32])),
    "beam_width": (st.none() | st.integers(1, 3),
                   st.integers(0, 4) | st.sampled_from([33, UINT32])),
    "length_penalty": (st.none() | st.floats(-FLT_MAX, FLT_MAX, width=32), any_float),
    "early_stopping": (st.integers(0, 2), st.integers(-(2**31), 2**31 - 1)),
    # Single characters and short strings match the random model's text now and then.
    "stop": (st.lists(st.sampled_from(["e", " ", "a", "th", "\n"]) | st.text(min_size=1,
                                                                          max_size=256),
                      max_size=64),
             st.lists(st.text(max_size=300), max_size=70)),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
    "skip_special_tokens": (st.none() | st.booleans(), st.booleans()),
    "spaces_between_special_tokens": (st.none() | st.booleans(), st.booleans()),
    # Logits processors. min_tokens stays within the max_tokens above when allowed.
    "min_tokens": (st.none() | st.integers(0, 1), st.integers(0, UINT32)),
    "repetition_penalty": (st.none() | st.floats(0, FLT_MAX, exclude_min=True, width=32),
                           any_float),
    "presence_penalty": (st.none() | st.floats(-2, 2, width=32), any_float),
    "frequency_penalty": (st.none() | st.floats(-2, 2, width=32), any_float),
    "min_p": (st.none() | st.floats(0, 1, width=32), any_float),
    "logit_bias": (st.dictionaries(st.integers(0, 2047), st.floats(-100, 100, width=32),
                                   max_size=8),
                   st.dictionaries(st.integers(0, UINT32), any_float, max_size=8)
                   | st.builds(lambda k: dict.fromkeys(range(k), 1.0), st.integers(1020, 1030))),
    "allowed_token_ids": (st.lists(st.integers(0, 2047), max_size=20),
                          st.lists(st.integers(0, UINT32), max_size=20)),
    "bad_words": (st.lists(st.text(min_size=1, max_size=256).filter(str.strip), max_size=4),
                  st.lists(st.text(max_size=300), max_size=6)
                  | st.builds(lambda k: ["w"] * k, st.integers(60, 70))),
    # (oneof field, value): valid constraints, and ones llguidance or the limits refuse.
    "structured_output": (st.none() | st.sampled_from(VALID_STRUCTURED),
                          st.sampled_from(INVALID_STRUCTURED)),
    "logprobs": (st.none() | st.integers(0, 20), st.integers(0, UINT32)),
    "prompt_logprobs": (st.none() | st.integers(0, 20), st.integers(0, UINT32)),
    "logprobs_mode": (st.just(0), st.integers(-(2**31), 2**31 - 1)),
    "request_id": (st.just("") | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e,
                                                      exclude_characters="/"), max_size=256),
                   st.text(max_size=20) | st.text(min_size=250, max_size=300)),
    # any unicode: up to 64 characters is at most 256 bytes of UTF-8; the wild ones pass it
    "cache_salt": (st.just("") | st.text(max_size=64),
                   st.text(min_size=60, max_size=300)),
    "input": (st.sampled_from(["text", "token_ids", "chat"]),
              st.sampled_from(["huge text", "wild text", "wild token_ids", "wild chat",
                               "none"])),
}
SAMPLING_FIELDS = [f for f in FIELDS
                   if f not in ("request_id", "cache_salt", "input", "structured_output")]

roles = st.sampled_from(["user", "system", "assistant"])
chat_messages = st.lists(st.builds(pb.ChatMessage, role=roles, content=st.text(max_size=100)),
                         min_size=1, max_size=4)
wild_chat_messages = st.lists(st.builds(pb.ChatMessage, role=roles | st.text(max_size=70),
                                        content=st.text(max_size=100)), max_size=4)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    values = {field: draw(allowed) for field, (allowed, _) in FIELDS.items()}
    if (n := values["n"]) is not None and (width := values["beam_width"] or 1) > 1:
        values["n"] = min(n, width)  # beam search returns at most beam_width sequences
    if (values["beam_width"] or 1) > 1:  # logprobs are not offered with beam search
        values["logprobs"] = values["prompt_logprobs"] = None
    for field in draw(st.lists(st.sampled_from(list(FIELDS)), max_size=2, unique=True)):
        values[field] = draw(FIELDS[field][1])
    sampling = pb.SamplingParams(**{f: values[f] for f in SAMPLING_FIELDS
                                    if values[f] is not None})
    if values["structured_output"] is not None:
        set_structured(sampling, values["structured_output"])
    msg = pb.GenerateRequest(request_id=values["request_id"], cache_salt=values["cache_salt"],
                             sampling=sampling)
    match values["input"]:
        case "text":
            msg.text = draw(st.text(min_size=1, max_size=120))
        case "huge text":
            msg.text = draw(st.builds(lambda ch, k: ch * k, st.characters(),
                                      st.integers(1, 300_000)))
        case "wild text":
            msg.text = draw(st.text(max_size=120))
        case "token_ids":
            msg.token_ids.CopyFrom(pb.TokenIds(ids=draw(st.lists(st.integers(5, 2047),
                                                                 min_size=1, max_size=40))))
        case "wild token_ids":
            ids = draw(st.lists(st.integers(0, UINT32), max_size=40)
                       | st.builds(lambda k: [7] * k, st.integers(2000, 5000)))
            msg.token_ids.CopyFrom(pb.TokenIds(ids=ids))
        case "chat" | "wild chat":
            messages = chat_messages if values["input"] == "chat" else wild_chat_messages
            msg.chat.CopyFrom(pb.Chat(messages=draw(messages)))
            if (add := draw(st.none() | st.booleans())) is not None:
                msg.chat.add_generation_prompt = add
    return msg


# ---- the oracle: the documented rules ------------------------------------------------------
