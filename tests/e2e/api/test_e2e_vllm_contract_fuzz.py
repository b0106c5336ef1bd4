"""Fuzzing the vLLM worker contract of a real `folio serve` (the tiny model): random Generate
requests over every SamplingParams field, valid and not, and random sequences of KV-event
subscriptions, cancellations and FlushCache calls.

Oracle: the contract's own rules and the refusals docs/architecture.md lists (what Folio does
not do is UNIMPLEMENTED; a value out of range is INVALID_ARGUMENT with a message), and the
stream's shape for whatever completes (one GenerateComplete per index, chunks adding up to
its output ids, counts that match). Nothing else may happen; afterwards the server is alive,
healthy and idle with every KV block free.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2

from tests.e2e.e2e_util import wait_idle

pytestmark = pytest.mark.timeout(600)

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
FLOAT = st.floats(width=32, allow_nan=True, allow_infinity=True)
SMALL_FLOAT = st.floats(-3, 3, width=32)


@pytest.fixture(scope="module")
def vllm(default_server):
    with grpc.insecure_channel(default_server.address) as channel:
        yield vpb_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def vocab_size(vllm) -> int:
    return vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10).vocab_size


def maybe(strategy):
    return st.one_of(st.none(), strategy)


def pick(draw, wild: bool, valid, anything):
    """A value from `valid`, or (in a wild request, one time in four) from `anything`."""
    return draw(maybe(anything if wild and draw(st.integers(0, 3)) == 0 else valid))


@st.composite
def sampling_params(draw, wild: bool) -> vpb.SamplingParams:
    fields = dict(
        temperature=pick(draw, wild, st.floats(0, 2, width=32), FLOAT),
        top_p=pick(draw, wild, st.floats(0.25, 1, width=32), FLOAT),
        top_k=pick(draw, wild, st.integers(0, 50), UINT32),
        min_p=pick(draw, wild, st.floats(0, 1, width=32), FLOAT),
        frequency_penalty=pick(draw, wild, st.floats(-2, 2, width=32), FLOAT),
        presence_penalty=pick(draw, wild, st.floats(-2, 2, width=32), FLOAT),
        repetition_penalty=pick(draw, wild, st.floats(0.5, 2, width=32), FLOAT),
        max_tokens=pick(draw, wild, st.integers(1, 6), st.just(0)),
        min_tokens=pick(draw, wild, st.integers(0, 1), st.just(100)),
        stop=pick(draw, wild, st.lists(st.text(min_size=1, max_size=4), max_size=3),
                  st.lists(st.text(max_size=300), max_size=3)),
        stop_token_ids=pick(draw, wild, st.lists(st.integers(5, 2000), max_size=3),
                            st.lists(UINT32, max_size=40)),
        skip_special_tokens=draw(maybe(st.booleans())),
        spaces_between_special_tokens=draw(maybe(st.booleans())),
        ignore_eos=draw(maybe(st.booleans())),
        n=pick(draw, wild, st.integers(0, 3), st.just(1000)),
        logprobs=pick(draw, wild, st.integers(0, 20), st.integers(-2, 22)),
        prompt_logprobs=pick(draw, wild, st.integers(0, 20), st.integers(-2, 22)),
        seed=pick(draw, wild, st.integers(0, 2**31 - 1), INT32),
        include_stop_str_in_output=draw(maybe(st.booleans())),
        logit_bias=pick(draw, wild, st.dictionaries(st.integers(0, 2000),
                                                    st.floats(-100, 100, width=32),
                                                    max_size=3),
                        st.dictionaries(st.integers(-5, 3000), FLOAT, max_size=3)),
        truncate_prompt_tokens=pick(draw, wild, st.integers(1, 40), st.integers(-2, 0)),
        grammar_from_first_token=draw(maybe(st.booleans())),
    )
    params = vpb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    constraints = ["json_schema", "regex", "grammar", "json_object", "choice"]
    match draw(st.sampled_from(["none"] * 5 + constraints + (["structural_tag"] if wild
                                                              else []))):
        case "json_schema":
            params.json_schema = draw(st.sampled_from(['{"type": "integer"}', "{", "[]"]
                                                      if wild else ['{"type": "integer"}']))
        case "regex":
            params.regex = draw(st.sampled_from(["[ab]{1,3}", "(", ""] if wild
                                                else ["[ab]{1,3}"]))
        case "grammar":
            params.grammar = draw(st.sampled_from(['root ::= "x" | "y"', "root ::= ("] if wild
                                                  else ['root ::= "x" | "y"']))
        case "structural_tag":
            params.structural_tag = "{}"
        case "json_object":
            params.json_object = True
        case "choice":
            params.choice.choices.extend(draw(st.lists(st.text(min_size=1, max_size=3),
                                                       min_size=1, max_size=3)))
    return params


@st.composite
def generate_requests(draw, vocab_size: int, wild: bool) -> vpb.GenerateRequest:
    request = vpb.GenerateRequest(
        request_id=draw(st.sampled_from(["", "fuzz-a/b"] if wild else [""])),
        sampling_params=draw(sampling_params(wild)), stream=draw(st.booleans()))
    inputs = ["tokens", "tokens", "text"] + (["none"] if wild else [])
    match draw(st.sampled_from(inputs)):
        case "tokens":
            ids = st.integers(0, vocab_size + 5 if wild else vocab_size - 1)
            request.tokenized.input_ids.extend(draw(st.lists(ids, min_size=int(not wild),
                                                             max_size=40)))
        case "text":
            request.text = draw(st.text(min_size=int(not wild), max_size=30))
    if wild and draw(st.integers(0, 4)) == 0:
        request.data_parallel_rank = draw(st.integers(-1, 2))
    if wild and draw(st.integers(0, 9)) == 0:
        request.kv_transfer_params_json = "{}"
    return request


def expected_refusals(request: vpb.GenerateRequest) -> set[grpc.StatusCode]:
    """The statuses the contract's rules alone decide, one per rule the request breaks (the
    first check to fail answers); empty when Folio's own checks decide."""
    p = request.sampling_params
    codes = set()
    if request.HasField("kv_transfer_params_json") or p.WhichOneof(
            "constraint") == "structural_tag":
        codes.add(grpc.StatusCode.UNIMPLEMENTED)
    if ((p.HasField("logprobs") and p.logprobs < 0)
            or (p.HasField("prompt_logprobs") and p.prompt_logprobs < 0)
            or (p.HasField("seed") and p.seed < 0)
            or (p.HasField("max_tokens") and p.max_tokens == 0)
            or (p.HasField("truncate_prompt_tokens") and p.truncate_prompt_tokens in (0, -2))
            or (request.HasField("data_parallel_rank") and request.data_parallel_rank != 0)
            or request.WhichOneof("input") is None):
        codes.add(grpc.StatusCode.INVALID_ARGUMENT)
    return codes


def check_completed(request: vpb.GenerateRequest, responses: list) -> None:
    p = request.sampling_params
    n = p.n or 1
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    completes = {r.complete.index: r.complete for r in responses
                 if r.WhichOneof("response") == "complete"}
    assert sorted(completes) == list(range(n))
    assert len([r for r in responses if r.WhichOneof("response") == "complete"]) == n
    if not request.stream:
        assert not chunks
    for index, done in completes.items():
        assert done.finish_reason in ("stop", "length")
        assert done.completion_tokens == len(done.output_ids)
        if p.HasField("max_tokens"):
            assert len(done.output_ids) <= p.max_tokens
        if request.stream:
            streamed = [t for c in chunks if c.index == index for t in c.token_ids]
            assert streamed == list(done.output_ids)


def fuzz_generate(vllm, vocab_size: int, wild: bool, examples: int) -> dict[str, int]:
    """Runs `examples` random requests (valid ones, or wild ones with any field anywhere) and
    counts their outcomes by status name."""
    seen: dict[str, int] = {}

    @settings(FUZZ, max_examples=examples)
    @given(request=generate_requests(vocab_size, wild))
    # Each refusal the contract names is met at least once, whatever the draws.
    @example(request=vpb.GenerateRequest(
        text="hi", kv_transfer_params_json="{}",
        sampling_params=vpb.SamplingParams(max_tokens=2)))
    @example(request=vpb.GenerateRequest(
        text="hi", sampling_params=vpb.SamplingParams(structural_tag="{}")))
    @example(request=vpb.GenerateRequest(
        text="hi", sampling_params=vpb.SamplingParams(max_tokens=0)))
    def run(request):
        expected = expected_refusals(request)
        try:
            responses = list(vllm.Generate(request, timeout=60))
        except grpc.RpcError as e:
            seen[e.code().name] = seen.get(e.code().name, 0) + 1
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.UNIMPLEMENTED), (e.code(), e.details())
            assert not expected or e.code() in expected, (expected, e.details())
            assert len(e.details()) > 10
            return
        seen["OK"] = seen.get("OK", 0) + 1
        assert not expected, f"expected {expected}, the request completed"
        check_completed(request, responses)

    run()
    return seen


def test_fuzz_generate_fields(vllm, vocab_size, default_server):
    # about 1.2 s an example on 2 cores. The two sides are separate runs, so each side's share
    # is fixed by construction rather than by how Hypothesis happens to spread its draws.
    valid = fuzz_generate(vllm, vocab_size, wild=False, examples=30)
    wild = fuzz_generate(vllm, vocab_size, wild=True, examples=30)
    # Valid requests complete, unless one of Folio's own limits refuses them (with a message,
    # INVALID_ARGUMENT); wild ones mostly break a rule.
    assert valid.get("OK", 0) >= 20 and valid.get("UNIMPLEMENTED", 0) == 2, valid
    assert wild.get("INVALID_ARGUMENT", 0) >= 8 and wild.get("UNIMPLEMENTED", 0) >= 2, wild
    assert default_server.proc.poll() is None, default_server.log_tail()
    assert vllm.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
    wait_idle(default_server.address)


# ---- SubscribeKvEvents and FlushCache ------------------------------------------------------

kv_ops = st.lists(st.one_of(
    st.tuples(st.just("subscribe"), st.one_of(st.just(0), st.integers(1, 2**40),
                                              st.integers(2**63, 2**64 - 1))),
    st.tuples(st.just("cancel"), st.integers(0, 7)),
    st.tuples(st.just("generate"), st.integers(0, 3)),  # a prompt family: shared prefixes
    st.tuples(st.just("flush"), st.one_of(st.floats(0, 0.5, width=32), FLOAT)),
), max_size=12)


def test_fuzz_kv_event_subscribers_and_flushes(vllm, default_server):
    """Random subscribe (any cursor) / cancel / generate / flush (any timeout_s) sequences.
    Each subscription that opens numbers its batches from its cursor + 1 on, without a gap,
    starting with a snapshot (AllBlocksCleared first); a cursor above 2^63 - 1 and a timeout
    outside 0..3600 are INVALID_ARGUMENT; a flush of an idle server succeeds. Afterwards the
    server is healthy and idle."""
    block_size = vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10).block_size
    seen: dict[str, int] = {}
    unique = iter(range(10**9))

    def generate(family: int) -> None:
        prefix = [200 + family] * (2 * block_size)
        ids = prefix + [300 + next(unique) % 1500 for _ in range(block_size + 1)]
        request = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids),
                                      sampling_params=vpb.SamplingParams(max_tokens=1,
                                                                         ignore_eos=True))
        assert list(vllm.Generate(request, timeout=60))[-1].complete.finish_reason == "length"

    @FUZZ
    @given(ops=kv_ops)
    def run(ops):
        calls: list[tuple[object, int]] = []  # (stream, the sequence number it is at)
        try:
            for op, arg in ops:
                match op:
                    case "subscribe":
                        call = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(
                            start_sequence_number=arg), timeout=60)
                        if arg > 2**63 - 1:
                            with pytest.raises(grpc.RpcError) as e:
                                next(call)
                            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                            seen["bad cursor"] = seen.get("bad cursor", 0) + 1
                            continue
                        first = next(call)
                        assert first.sequence_number == arg + 1
                        assert first.snapshot.index == 0 and first.events[0].HasField("cleared")
                        calls.append((call, arg + 1))
                    case "cancel" if calls:
                        calls.pop(arg % len(calls))[0].cancel()
                    case "generate":
                        generate(arg)
                    case "flush":
                        bad = not (math.isfinite(arg) and 0 <= arg <= 3600)
                        try:
                            response = vllm.FlushCache(common_pb2.FlushCacheRequest(
                                timeout_s=arg), timeout=30)
                        except grpc.RpcError as e:
                            assert bad and e.code() == grpc.StatusCode.INVALID_ARGUMENT
                            seen["bad timeout"] = seen.get("bad timeout", 0) + 1
                            continue
                        assert not bad
                        # Requests run one at a time here: the server is idle or about to be
                        # (the last one's blocks are freed a loop turn after its stream ends,
                        # later on a loaded machine); given the time, the flush succeeds.
                        if not response.success:
                            assert "in flight hold its blocks" in response.message
                            assert vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=30),
                                                   timeout=60).success
            # A last, unique request stores a block every open stream must report, after
            # whatever snapshot it is still sending: numbered on without a gap.
            generate(4)
            for call, number in calls:
                while True:
                    batch = next(call)
                    number += 1
                    assert batch.sequence_number == number
                    if not batch.HasField("snapshot"):
                        break
                seen["streams read"] = seen.get("streams read", 0) + 1
        finally:
            for call, _ in calls:
                call.cancel()

    run()
    assert seen.get("streams read", 0) >= 10 and seen.get("bad cursor", 0) >= 3, seen
    assert seen.get("bad timeout", 0) >= 3, seen
    assert vllm.HealthCheck(vpb.HealthCheckRequest(), timeout=10).healthy
    wait_idle(default_server.address)
