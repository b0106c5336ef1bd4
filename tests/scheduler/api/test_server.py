"""The real gRPC server and engine loop against a null-model executor over real ZeroMQ.

Covers the handshake (version mismatch -> Reject), health, streaming, validation statuses,
cancellation and Abort freeing blocks, executor errors and executor loss. Token-exact runs with
the real executor live in tests/e2e/.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from protos.channel import ExecutorEnd
from protos.folio.v1 import generator_pb2 as pb
from protos.plan import PROTOCOL_VERSION, Reject, Welcome
from scheduler_svc.text.tokenizer import ChatTurn
from tests.scheduler.grpc_harness import (
    NOT_SERVING,
    SERVING,
    Harness,
    collect,
    gen_request,
    null_continuation,
)
from tests.scheduler.null_executor import make_hello

pytestmark = pytest.mark.timeout(60)


async def test_unavailable_before_an_executor_connects(harness):
    assert await harness.health_status() == NOT_SERVING
    assert await harness.health_status("folio.v1.Generator") == NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(harness.stub.Generate(gen_request()))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no executor connected" in err.value.details()
    stats = await harness.stats()
    assert not stats.executor_connected


async def test_version_mismatch_is_rejected_with_a_reason(harness):
    ex = harness.connect(hello=make_hello(protocol_version=PROTOCOL_VERSION + 1))
    await asyncio.to_thread(ex.join, 10)
    assert isinstance(ex.reply, Reject)
    assert ex.reply.reason == (f"executor speaks protocol v{PROTOCOL_VERSION + 1}, this "
                               f"scheduler v{PROTOCOL_VERSION}; run matching versions")
    assert await harness.health_status() == NOT_SERVING
    # A matching executor is still welcome afterwards.
    good = await harness.serve()
    assert isinstance(await asyncio.to_thread(good.wait_reply), Welcome)
    # A mismatched newcomer does not disturb the connected executor.
    late = harness.connect(hello=make_hello(protocol_version=PROTOCOL_VERSION + 1))
    await asyncio.to_thread(late.join, 10)
    assert isinstance(late.reply, Reject)
    responses = await collect(harness.stub.Generate(gen_request(max_tokens=2)))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert good.is_alive() and await harness.health_status() == SERVING


async def test_streams_tokens_text_finish_and_usage(harness, tiny_tokenizer):
    await harness.serve()
    assert await harness.health_status("folio.v1.Generator") == SERVING
    prompt = tiny_tokenizer.encode("hello world")
    responses = await collect(harness.stub.Generate(gen_request(prompt, max_tokens=6,
                                                                temperature=0)))
    tokens = [t for r in responses for t in r.token_ids]
    assert tokens == null_continuation(prompt, 6)
    assert "".join(r.text for r in responses) == tiny_tokenizer.decode(tokens)
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) \
        == (len(prompt), 6, 0)
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    stats = await harness.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.kv_blocks_free == stats.kv_blocks_total == 32
    assert stats.num_finished_requests == 1 and stats.num_generated_tokens == 6


async def test_concurrent_streams_and_text_and_chat_inputs(harness, tiny_tokenizer):
    await harness.serve()
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    calls = [harness.stub.Generate(pb.GenerateRequest(text="the quick brown fox",
                                                      sampling=pb.SamplingParams(max_tokens=4))),
             harness.stub.Generate(pb.GenerateRequest(chat=chat,
                                                      sampling=pb.SamplingParams(max_tokens=3))),
             harness.stub.Generate(gen_request(max_tokens=5))]
    results = await asyncio.gather(*(collect(c) for c in calls))
    prompts = [tiny_tokenizer.encode("the quick brown fox"),
               tiny_tokenizer.encode_chat([ChatTurn("user", "hi")]), [5, 6, 7]]
    for prompt, responses, n in zip(prompts, results, (4, 3, 5), strict=True):
        assert [t for r in responses for t in r.token_ids] == null_continuation(prompt, n)
        assert responses[-1].usage.prompt_tokens == len(prompt)
    tokenized = await harness.stub.Tokenize(pb.TokenizeRequest(chat=chat))
    assert list(tokenized.token_ids) == prompts[1]
    info = await harness.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.vocab_size, info.block_size, info.num_kv_blocks, info.max_model_len,
            info.random_weights) == (512, 4, 32, 64, True)


@pytest.mark.parametrize("request_msg, message", [
    (pb.GenerateRequest(text=""), "prompt text is empty"),
    (pb.GenerateRequest(), "has no input"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt is empty"),
    (gen_request([5, 512]), "token id 512 is out of range"),
    (gen_request(temperature=-0.5), "temperature must be >= 0"),
    (gen_request(top_p=0.0), "top_p must be in (0, 1]"),
    (gen_request(top_p=1.5), "top_p must be in (0, 1]"),
    (gen_request(top_k=-1), "top_k must be >= 0"),
    (gen_request(stop=["a", ""]), "stop string 1 must have 1 to 256 characters, got 0"),
    (gen_request(stop_token_ids=[9999]), "stop token id 9999 is out of range"),
    (gen_request(list(range(10, 75))), "prompt has 65 tokens but max_model_len is 64"),
    (pb.GenerateRequest(chat=pb.Chat()), "chat has no messages"),
], ids=lambda x: x if isinstance(x, str) else "")
async def test_invalid_requests_get_invalid_argument(harness, request_msg, message):
    await harness.serve()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(harness.stub.Generate(request_msg))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    # The server keeps serving.
    responses = await collect(harness.stub.Generate(gen_request(max_tokens=2)))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_duplicate_request_id_is_already_exists(harness):
    await harness.serve(step_delay_s=0.05)
    first = harness.stub.Generate(pb.GenerateRequest(
        request_id="dup", token_ids=pb.TokenIds(ids=[5]), sampling=pb.SamplingParams(max_tokens=20)))
    await first.read()  # the first request is running
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(harness.stub.Generate(pb.GenerateRequest(
            request_id="dup", token_ids=pb.TokenIds(ids=[5]))))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'dup' is already in use" in err.value.details()
    first.cancel()


async def wait_idle(harness: Harness) -> pb.ServerStats:
    for _ in range(200):
        stats = await harness.stats()
        if stats.num_running == stats.num_waiting == 0:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"requests never left the scheduler: {stats}")


async def test_client_cancel_aborts_and_frees_blocks(harness):
    await harness.serve(step_delay_s=0.05)
    call = harness.stub.Generate(gen_request(list(range(10, 30)), max_tokens=50))
    await call.read()
    stats = await harness.stats()
    assert stats.num_running == 1 and stats.kv_blocks_free < stats.kv_blocks_total
    call.cancel()
    stats = await wait_idle(harness)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_finished_requests == 1


async def test_abort_ends_the_stream_with_abort(harness):
    await harness.serve(step_delay_s=0.05)
    call = harness.stub.Generate(pb.GenerateRequest(
        request_id="victim", token_ids=pb.TokenIds(ids=[5, 6]),
        sampling=pb.SamplingParams(max_tokens=50)))
    await call.read()
    assert (await harness.stub.Abort(pb.AbortRequest(request_id="victim"))).found
    rest = await collect(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert not (await harness.stub.Abort(pb.AbortRequest(request_id="victim"))).found
    stats = await wait_idle(harness)
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_executor_error_fails_the_step_and_serving_continues(harness):
    await harness.serve(fail_step=1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(harness.stub.Generate(gen_request(max_tokens=5)))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "executor failed step 1: simulated CUDA error" in err.value.details()
    responses = await collect(harness.stub.Generate(gen_request(max_tokens=3)))
    assert [t for r in responses for t in r.token_ids] == null_continuation([5, 6, 7], 3)
    stats = await harness.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total




async def test_shutdown_tells_the_executor(harness):
    ex = await harness.serve()
    await harness.server.stop(grace_s=0.5)
    await asyncio.to_thread(ex.join, 5)
    assert ex.got_shutdown
    with contextlib.suppress(Exception):
        await harness.server.stop(grace_s=0.1)


async def test_resent_hello_is_welcomed_again_without_a_reset(harness):
    end = ExecutorEnd(harness.executor_address)
    try:
        hello = make_hello()
        assert await asyncio.to_thread(end.wait_connected, 5000)
        end.send(hello)
        assert isinstance(await asyncio.to_thread(end.recv, 5000), Welcome)
        connected = harness.server.engine.executor
        end.send(hello)  # an executor that gave up waiting resends its Hello
        assert isinstance(await asyncio.to_thread(end.recv, 5000), Welcome)
        assert harness.server.engine.executor is connected
        assert await harness.health_status() == SERVING
    finally:
        end.close()




@pytest.mark.parametrize("version", ["v1alpha", "v1"])
async def test_reflection_lists_and_describes_the_services(harness, version):
    """Both reflection services answer with their own message types: v1alpha from
    grpcio-reflection, v1 from the descriptor derived from it (scheduler_svc/api/reflection.py)."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    from scheduler_svc.api.reflection import V1Request, V1Response

    if version == "v1":
        request_type, response_type = V1Request, V1Response
    else:
        request_type = reflection_pb2.ServerReflectionRequest
        response_type = reflection_pb2.ServerReflectionResponse
    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{harness.server.port}") as channel:
        call = channel.stream_stream(method, request_serializer=request_type.SerializeToString,
                                     response_deserializer=response_type.FromString)()
        await call.write(request_type(list_services=""))
        listed = await call.read()
        await call.write(request_type(file_containing_symbol="folio.v1.Generator"))
        described = await call.read()
        await call.write(request_type(
            file_containing_symbol="grpc.reflection.v1.ServerReflection"))
        v1_described = await call.read()
        await call.done_writing()
    names = {s.name for s in listed.list_services_response.service}
    assert {"folio.v1.Generator", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    assert "Generator" in {s.name for f in files if f.package == "folio.v1" for s in f.service}
    v1_files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                for b in v1_described.file_descriptor_response.file_descriptor_proto]
    assert [(f.package, [m.input_type for s in f.service for m in s.method]) for f in v1_files
            ] == [("grpc.reflection.v1", [".grpc.reflection.v1.ServerReflectionRequest"])]


async def test_unexpected_errors_become_internal_and_serving_continues(harness, tiny_tokenizer,
                                                                        monkeypatch):
    await harness.serve()

    def broken_encode(text, add_special_tokens=True):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(tiny_tokenizer, "encode", broken_encode)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.stub.Tokenize(pb.TokenizeRequest(text="hi"))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError: tokenizer exploded" in err.value.details()
    monkeypatch.undo()
    assert list((await harness.stub.Tokenize(pb.TokenizeRequest(text="hi"))).token_ids) == \
        tiny_tokenizer.encode("hi")


async def test_cached_tokens_and_memory_stats(harness):
    await harness.serve(hello=make_hello(num_swap_blocks=8))
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks of 4
    first = await collect(harness.stub.Generate(gen_request(prompt, max_tokens=2)))
    second = await collect(harness.stub.Generate(gen_request(prompt + [40], max_tokens=2)))
    assert first[-1].usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens == 20  # the 5 full blocks computed by the first
    tokens = [t for r in second for t in r.token_ids]
    assert tokens == null_continuation(prompt + [40], 2)
    stats = await wait_idle(harness)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21 + 22, 20)
    assert stats.prefix_cache_hit_rate == pytest.approx(20 / 43)
    assert stats.num_prompt_tokens == 21 + 2  # cached tokens are not computed again
    assert (stats.num_swapped, stats.swap_blocks_total, stats.swap_blocks_free) == (0, 8, 8)
    assert stats.kv_blocks_free == stats.kv_blocks_total



def test_served_model_name_is_never_a_path(tmp_path):
    from scheduler_svc.api.server import served_model_name
    from scheduler_svc.config import SchedulerConfig

    gguf_file = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf_file.write_bytes(b"GGUF")
    cache_entry = tmp_path / "cache" / "gguf" / ("ab" * 32)
    for model, expected in [(str(gguf_file), "SmolLM2-135M-Instruct.Q4_1"),
                            (str(tmp_path), tmp_path.name),  # a directory holding a .gguf
                            ("org/some-model", "org/some-model")]:  # a hub id
        config = SchedulerConfig(model=model)
        assert served_model_name(config, cache_entry) == expected, model
    assert served_model_name(SchedulerConfig(model=model, served_model_name="x"),
                             cache_entry) == "x"
