"""Every request field is checked where it enters, with the allowed range and the value in the
message; undecodable requests are INVALID_ARGUMENT; prompts are size-checked before any
tokenizing, and tokenized off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import grpc
import pytest

from protos.folio.v1 import generator_pb2 as pb
from protos.plan import SamplingSpec
from scheduler_svc.api import inputs
from scheduler_svc.api.server import MAX_REQUEST_BYTES
from scheduler_svc.errors import InvalidRequest
from tests.scheduler.front_end import raw_generate, raw_unary, with_invalid_utf8
from tests.scheduler.grpc_harness import SERVING, collect, gen_request, null_continuation
from tests.scheduler.null_executor import make_hello

pytestmark = pytest.mark.timeout(60)

FLT_MAX = 3.4028234663852886e38


def submit(**fields) -> None:
    sampling = fields.pop("sampling", {})
    inputs.submit_params(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(**sampling),
                                            **fields))


@pytest.mark.parametrize("sampling, message", [
    (dict(temperature=math.nan), "temperature must be >= 0 and finite (0 = greedy), got nan"),
    (dict(temperature=math.inf), "temperature must be >= 0 and finite (0 = greedy), got inf"),
    (dict(temperature=-1e-30), "temperature must be >= 0 and finite (0 = greedy), got -1e-30"),
    (dict(top_p=math.nan), "top_p must be in (0, 1], got nan"),
    (dict(top_p=-0.0), "top_p must be in (0, 1], got -0"),
    (dict(top_p=1.0000001), "top_p must be in (0, 1], got 1"),
    (dict(top_k=-(2**31)), f"top_k must be >= 0 (0 = off), got {-(2**31)}"),
    (dict(seed=2**64 - 1), f"seed must be in [0, {2**63 - 1}], got {2**64 - 1}"),
    (dict(stop=["x"] * 65), "stop may hold at most 64 strings, got 65"),
    (dict(stop=["ok", ""]), "stop string 1 must have 1 to 256 characters, got 0 (an empty "
                            "string would stop at once; leave it out)"),
    (dict(stop=["é" * 257]), "stop string 0 must have 1 to 256 characters, got 257: "),
    (dict(stop_token_ids=list(range(33))), "stop_token_ids may hold at most 32 ids, got 33"),
    (dict(n=2**32 - 1), f"n must be between 1 and 128 sequences, got {2**32 - 1}"),
    (dict(beam_width=33), "beam_width must be between 1 (no beam search) and 32, got 33"),
    (dict(beam_width=4, length_penalty=-math.inf), "length_penalty must be a finite number, "
                                                   "got -inf"),
    (dict(early_stopping=-5), "unknown early_stopping value -5"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens (5) may not exceed max_tokens (4)"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0 and finite (1 = off), got 0"),
    (dict(repetition_penalty=math.inf), "repetition_penalty must be > 0 and finite"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2] (0 = off), got 2.5"),
    (dict(frequency_penalty=math.nan), "frequency_penalty must be in [-2, 2] (0 = off), got nan"),
    (dict(min_p=-0.5), "min_p must be in [0, 1] (0 = off), got -0.5"),
    (dict(logit_bias={7: 100.5}), "logit_bias for token 7 must be in [-100, 100], got 100.5"),
    (dict(logit_bias=dict.fromkeys(range(1025), 1.0)),
     "logit_bias may hold at most 1024 entries, got 1025"),
    (dict(bad_words=["w"] * 65), "bad_words may hold at most 64 words, got 65"),
    (dict(bad_words=["ok", "  "]), "bad_words[1] must have 1 to 256 characters, not all "
                                   "whitespace; got '  '"),
    (dict(bad_words=["x" * 257]), "bad_words[0] must have 1 to 256 characters"),
    (dict(beam_width=2, min_p=0.1, bad_words=["x"]),
     "beam search (beam_width > 1) does not support min_p, bad_words"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_sampling_values_say_the_range_and_the_value(sampling, message):
    with pytest.raises(InvalidRequest) as err:
        submit(sampling=sampling)
    assert message in str(err.value)


@pytest.mark.parametrize("sampling", [
    dict(temperature=FLT_MAX), dict(temperature=1e-45), dict(top_p=1e-45), dict(top_k=2**31 - 1),
    dict(seed=2**63 - 1), dict(max_tokens=2**32 - 1), dict(stop_token_ids=[2**32 - 1] * 32),
    dict(beam_width=2, length_penalty=FLT_MAX), dict(beam_width=2, length_penalty=-FLT_MAX),
    dict(n=128), dict(stop=["😀" * 256] * 64), dict(stop=["\n"], include_stop_str_in_output=True),
    dict(skip_special_tokens=False, spaces_between_special_tokens=False),
    dict(min_tokens=4, max_tokens=4), dict(min_tokens=2**32 - 1),
    dict(repetition_penalty=FLT_MAX), dict(repetition_penalty=1e-45),
    dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(min_p=1.0),
    dict(logit_bias=dict.fromkeys(range(1024), -100.0)), dict(bad_words=["x" * 256] * 64),
    dict(beam_width=2, repetition_penalty=1.0, min_tokens=0, min_p=0.0),
], ids=lambda x: repr(x)[:60])
def test_extreme_values_the_math_can_take_are_allowed(sampling):
    submit(sampling=sampling)


def test_max_tokens_zero_or_unset_means_the_rest_of_the_context():
    for sampling in ({}, dict(max_tokens=0)):
        params = inputs.submit_params(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5] * 10), sampling=pb.SamplingParams(**sampling)))
        params = dataclasses.replace(params, prompt_token_ids=[5] * 10)
        assert inputs.check_for_executor(params, vocab_size=512, max_model_len=64) == 54


@pytest.mark.parametrize("req_id, message", [
    ("x" * 257, "request_id may have at most 256 characters, got 257"),
    ("tab\there", "request_id may hold only printable characters"),
    ("line\nbreak", "request_id may hold only printable characters"),
    ("nul\x00", "request_id may hold only printable characters"),
    ("a/b", "request_id 'a/b' may not contain '/'"),
])
def test_bad_request_ids(req_id, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(")):
        submit(request_id=req_id)


def test_printable_unicode_request_ids_are_fine():
    for req_id in ["x" * 256, "client 42: 東京 🚀", ""]:
        submit(request_id=req_id)


@pytest.mark.parametrize("messages, message", [
    ([pb.ChatMessage(role="", content="hi")], "chat message 0: role must be 1 to 64 printable"),
    ([pb.ChatMessage(role="user", content="a"), pb.ChatMessage(role="x" * 65, content="b")],
     "chat message 1: role must be 1 to 64"),
    ([pb.ChatMessage(role="us\ner", content="hi")], "role must be 1 to 64 printable"),
    ([pb.ChatMessage(role="user")] * 65, "the chat has 65 messages, more than max_model_len "
                                         "(64) tokens can hold"),
])
async def test_bad_chats_are_invalid_argument(harness, messages, message):
    await harness.serve()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=messages)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


# ---- requests protobuf cannot decode -------------------------------------------------------

UNDECODABLE_GENERATE = {
    "text": with_invalid_utf8(pb.GenerateRequest(text="TEXT"), "TEXT"),
    "request_id": with_invalid_utf8(pb.GenerateRequest(request_id="RQID", text="hi"), "RQID"),
    "chat role": with_invalid_utf8(pb.GenerateRequest(chat=pb.Chat(messages=[
        pb.ChatMessage(role="ROLE", content="hi")])), "ROLE"),
    "chat content": with_invalid_utf8(pb.GenerateRequest(chat=pb.Chat(messages=[
        pb.ChatMessage(role="user", content="CTNT")])), "CTNT"),
    "truncated": pb.GenerateRequest(text="hello there").SerializeToString()[:-3],
    "garbage": b"\xff" * 16,
}


@pytest.mark.parametrize("data", UNDECODABLE_GENERATE.values(), ids=UNDECODABLE_GENERATE.keys())
async def test_undecodable_generate_is_invalid_argument(harness, data):
    await harness.serve()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw_generate(harness.server.port, data)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not decode the request as a folio.v1.GenerateRequest" in err.value.details()
    assert "valid UTF-8" in err.value.details()
    responses = await collect(harness.stub.Generate(gen_request(max_tokens=2)))
    assert [t for r in responses for t in r.token_ids] == null_continuation([5, 6, 7], 2)


@pytest.mark.parametrize("method, data, response_cls", [
    ("Tokenize", with_invalid_utf8(pb.TokenizeRequest(text="TEXT"), "TEXT"),
     pb.TokenizeResponse),
    ("Abort", with_invalid_utf8(pb.AbortRequest(request_id="RQID"), "RQID"), pb.AbortResponse),
], ids=["Tokenize", "Abort"])
async def test_undecodable_unary_calls_are_invalid_argument(harness, method, data,
                                                            response_cls):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw_unary(harness.server.port, method, data, response_cls)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not decode the request as a folio.v1." in err.value.details()


async def test_a_message_over_the_size_limit_is_resource_exhausted(harness):
    await harness.serve()
    big = pb.GenerateRequest(text="a" * (MAX_REQUEST_BYTES + 1)).SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw_generate(harness.server.port, big)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await harness.health_status() == SERVING


# ---- prompt size: a cheap check first, then tokenizing off the event loop ------------------

LONG_CONTEXT = 400_000  # tokens; the tiny vocabulary's longest entry is 12 characters


async def serve_long_context(harness):
    return await harness.serve(hello=make_hello(max_model_len=LONG_CONTEXT, block_size=16,
                                                num_kv_blocks=LONG_CONTEXT // 16))


@pytest.fixture
def encode_calls(tiny_tokenizer, monkeypatch) -> list[int]:
    """The lengths of the texts the tokenizer was asked to encode."""
    calls: list[int] = []
    encode = tiny_tokenizer.encode

    def spy(text, add_special_tokens=True):
        calls.append(len(text))
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tiny_tokenizer, "encode", spy)
    return calls


async def test_oversized_text_is_refused_before_tokenizing(harness, tiny_tokenizer,
                                                           encode_calls):
    await serve_long_context(harness)
    limit = LONG_CONTEXT * tiny_tokenizer.max_token_chars()
    assert tiny_tokenizer.max_token_chars() == len("<|im_start|>")
    for request in (pb.GenerateRequest(text="x" * (limit + 1)),
                    pb.GenerateRequest(chat=pb.Chat(messages=[
                        pb.ChatMessage(role="user", content="y" * (limit - 3))]))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(harness.stub.Generate(request))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert f"has {limit + 1} characters, more than max_model_len ({LONG_CONTEXT})" in details
        assert f"longest token of this model's vocabulary is 12 characters, so at most {limit}" \
            in details
    assert encode_calls == []  # refused on its length alone


async def test_oversized_token_ids_are_refused(harness):
    await harness.serve()  # max_model_len 64
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(harness.stub.Generate(gen_request(list(range(10, 10 + 100_000)))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt has 100000 tokens but max_model_len is 64" in err.value.details()


async def test_health_answers_while_a_large_prompt_is_tokenized(harness, encode_calls):
    await serve_long_context(harness)
    text = "hello world " * 100_000  # allowed by its length; ~800k tokens once tokenized
    call = harness.stub.Generate(pb.GenerateRequest(text=text))
    generate = asyncio.ensure_future(collect(call))
    num_answers = 0
    while not generate.done():
        assert await harness.health_status() == SERVING
        num_answers += int(not generate.done())
        await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"but max_model_len is {LONG_CONTEXT}" in err.value.details()
    assert encode_calls == [len(text)]
    # Tokenizing blocked nothing: health kept answering while the call was in flight (on the
    # event loop, every health call would have waited for the whole encode).
    assert num_answers >= 5, num_answers


async def test_tokenize_works_without_an_executor_and_checks_size(harness, tiny_tokenizer):
    # No executor: the bound uses the model's own limit (config.json has none: 2048).
    ids = await harness.stub.Tokenize(pb.TokenizeRequest(text="hello world"))
    assert list(ids.token_ids) == tiny_tokenizer.encode("hello world")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Tokenize(pb.TokenizeRequest(text="z" * (2048 * 12 + 1)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than max_model_len (2048) tokens can hold" in err.value.details()


@pytest.mark.parametrize("field, sampling", [
    ("logit_bias", SamplingSpec(logit_bias=((3, 1.0), (300, 1.0)))),
    ("allowed_token_ids", SamplingSpec(allowed_token_ids=(5, 300))),
    ("bad_words", SamplingSpec(bad_words=((4,), (5, 300)))),
])
def test_processor_token_ids_are_checked_against_the_vocabulary(field, sampling):
    params = dataclasses.replace(inputs.submit_params(pb.GenerateRequest(text="hi")),
                                 prompt_token_ids=[1, 2], sampling=sampling)
    with pytest.raises(InvalidRequest, match=f"{field} token id 300 is out of range: the "
                                             "model's vocabulary has 300 tokens"):
        inputs.check_for_executor(params, 300, 100)
    inputs.check_for_executor(params, 301, 100)


def test_bad_words_tokenize_as_is_and_after_a_space_when_that_is_a_new_first_token():
    vocab = {"foo": [10], " foo": [11], "foo bar": [10, 12], " foo bar": [11, 12],
             "x": [20], " x": [20], "ab": [30, 31], " ab": [32]}
    got = inputs.bad_words_token_ids(("foo", "  foo bar", "x", "ab"), vocab.__getitem__)
    # "x": the spaced form starts with the same token; "ab": not as many tokens.
    assert got == ((10,), (11,), (10, 12), (11, 12), (20,), (30, 31))
