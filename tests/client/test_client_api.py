"""The Python client library (sync and asyncio) against a real server on the default model."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from client import AsyncFolioClient, Completion, FolioClient
from client.messages import Choices, generate_request, sampling_params
from protos.folio.v1 import generator_pb2 as pb


def test_unset_sampling_fields_stay_unset():
    params = sampling_params(temperature=0.0, max_tokens=4)
    assert params.HasField("temperature") and params.temperature == 0.0  # 0 = greedy, set
    assert not params.HasField("top_p") and not params.HasField("seed")


def test_sequence_and_beam_fields():
    params = sampling_params(n=4, beam_width=4, length_penalty=0.5, early_stopping="never")
    assert (params.n, params.beam_width, params.length_penalty) == (4, 4, 0.5)
    assert params.early_stopping == pb.EARLY_STOPPING_NEVER
    assert not sampling_params().HasField("n")
    with pytest.raises(ValueError, match="early_stopping"):
        sampling_params(early_stopping="sometimes")
    with pytest.raises(ValueError, match="generate_choices"):
        FolioClient("127.0.0.1:9").generate_text("hi", n=2)


def test_choices_fold_interleaved_sequences_by_index():
    choices = Choices()
    for index, ids, text in [(1, [5], "b"), (0, [3], "a"), (1, [6], "B"), (0, [4], "A")]:
        choices.add(pb.GenerateResponse(request_id="r", index=index, token_ids=ids, text=text))
    choices.add(pb.GenerateResponse(request_id="r", index=0,
                                    finish_reason=pb.FINISH_REASON_STOP))
    first, second = choices.completions
    assert (first.index, first.token_ids, first.text, first.finish_reason) == (0, [3, 4], "aA",
                                                                               "stop")
    assert (second.index, second.token_ids, second.text, second.finish_reason) == (
        1, [5, 6], "bB", None)


def test_generate_request_needs_exactly_one_input():
    with pytest.raises(ValueError):
        generate_request("text", token_ids=[1])
    with pytest.raises(ValueError):
        generate_request()
    req = generate_request(messages=[("user", "hi")], add_generation_prompt=False)
    assert req.WhichOneof("input") == "chat" and req.chat.add_generation_prompt is False


def test_completion_folds_a_stream():
    c = Completion()
    c.add(pb.GenerateResponse(request_id="r", token_ids=[1, 2], text="ab"))
    c.add(pb.GenerateResponse(request_id="r", token_ids=[3], text="c",
                              finish_reason=pb.FINISH_REASON_LENGTH,
                              usage=pb.Usage(prompt_tokens=4, completion_tokens=3)))
    assert c.to_dict() == {"request_id": "r", "index": 0, "token_ids": [1, 2, 3], "text": "abc",
                           "finish_reason": "length", "matched_stop": None,
                           "usage": {"prompt_tokens": 4, "completion_tokens": 3,
                                     "cached_tokens": 0}}
    for matched in (dict(matched_token_id=0), dict(matched_stop_str="\n")):
        c = Completion()
        c.add(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP, **matched))
        assert c.finish_reason == "stop" and c.matched_stop == next(iter(matched.values()))


def test_text_options_reach_the_request():
    req = generate_request("Hi", stop="END", include_stop_str_in_output=True,
                           skip_special_tokens=False, spaces_between_special_tokens=False)
    p = req.sampling
    assert list(p.stop) == ["END"] and p.include_stop_str_in_output
    assert p.HasField("skip_special_tokens") and not p.skip_special_tokens
    assert p.HasField("spaces_between_special_tokens") and not p.spaces_between_special_tokens
    p = generate_request("Hi", stop=["a", "b"]).sampling
    assert list(p.stop) == ["a", "b"] and not p.HasField("skip_special_tokens")


def test_completion_folds_logprobs():
    def entry(token_id, logprob, rank, *top):
        return pb.TokenLogprobs(token_id=token_id, logprob=logprob, rank=rank,
                                top_logprobs=[pb.Logprob(token_id=t, logprob=v) for t, v in top])

    c = Completion()
    c.add(pb.GenerateResponse(token_ids=[7], logprobs=[entry(7, -0.5, 1, (7, -0.5))],
                              prompt_logprobs=[entry(3, -2.0, 4, (9, -1.0))]))
    c.add(pb.GenerateResponse(token_ids=[8], logprobs=[entry(8, -1.5, 2, (1, -0.25))],
                              finish_reason=pb.FINISH_REASON_LENGTH))
    out = c.to_dict()
    assert out["logprobs"] == [
        {"token_id": 7, "logprob": -0.5, "rank": 1,
         "top_logprobs": [{"token_id": 7, "logprob": -0.5}]},
        {"token_id": 8, "logprob": -1.5, "rank": 2,
         "top_logprobs": [{"token_id": 1, "logprob": -0.25}]}]
    assert out["prompt_logprobs"] == [{"token_id": 3, "logprob": -2.0, "rank": 4,
                                       "top_logprobs": [{"token_id": 9, "logprob": -1.0}]}]
    p = generate_request("Hi", logprobs=0, prompt_logprobs=3).sampling
    assert p.HasField("logprobs") and p.logprobs == 0 and p.prompt_logprobs == 3
    assert not generate_request("Hi").sampling.HasField("logprobs")


def test_wait_ready_gives_up_in_time():
    with FolioClient("127.0.0.1:1") as client, pytest.raises(TimeoutError):
        client.wait_ready(timeout=0.5)


def test_sync_client(default_server):
    with FolioClient(default_server.address, timeout=60) as client:
        client.wait_ready(timeout=10)
        responses = list(client.generate("Hi", max_tokens=4, ignore_eos=True, request_id="s1"))
        assert all(r.request_id == "s1" for r in responses)
        assert sum(len(r.token_ids) for r in responses) == 4
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert [r.finish_reason for r in responses[:-1]] == [0] * (len(responses) - 1)
        greedy = [client.generate_text(token_ids=[10, 20, 30], max_tokens=6, temperature=0.0,
                                       ignore_eos=True).token_ids for _ in range(2)]
        assert greedy[0] == greedy[1] and len(greedy[0]) == 6
        assert client.abort("no-such-request") is False
        asked = client.generate_text(token_ids=[10, 20, 30], max_tokens=6, temperature=0.0,
                                     ignore_eos=True, logprobs=2, prompt_logprobs=1)
        assert asked.token_ids == greedy[0]
        assert [e["token_id"] for e in asked.logprobs] == asked.token_ids
        assert all(e["rank"] == 1 and len(e["top_logprobs"]) == 2 for e in asked.logprobs)
        assert [e["token_id"] for e in asked.prompt_logprobs] == [20, 30]
        assert client.tokenize("Hi")[-1] != client.tokenize("Hi there")[-1]
        with pytest.raises(grpc.RpcError) as err:
            client.generate_text("x", top_k=-1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_async_client(default_server):
    async with AsyncFolioClient(default_server.address, timeout=60) as client:
        await client.wait_ready(timeout=10)
        assert await client.health() == "SERVING"
        done = await client.generate_text(messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 3
        chat_ids = await client.tokenize(messages=[("user", "Hi")])
        assert done.usage["prompt_tokens"] == len(chat_ids)
        assert (await client.model_info())["random_weights"] is True
        assert (await client.stats())["num_finished_requests"] >= 1
        assert await client.abort("no-such-request") is False


def test_shipped_health_proto_matches_the_grpc_runtime(tmp_path):
    """protos/grpc/health/v1/health.proto (for clients in other languages) must describe the
    same messages and methods as the grpc_health package the server runs."""
    from google.protobuf import descriptor_pb2
    from grpc_health.v1 import health_pb2
    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "health.pb"
    assert protoc.main(["protoc", f"-I{root}", f"--descriptor_set_out={out}",
                        str(root / "protos/grpc/health/v1/health.proto")]) == 0
    shipped = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    runtime = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(runtime)
    assert shipped.package == runtime.package == "grpc.health.v1"

    def shape(fd):
        messages = {m.name: sorted((f.name, f.number, f.type) for f in m.field)
                    for m in fd.message_type}
        methods = {m.name: (m.input_type, m.output_type, m.server_streaming)
                   for s in fd.service for m in s.method}
        return messages, methods

    shipped_messages, shipped_methods = shape(shipped)
    runtime_messages, runtime_methods = shape(runtime)
    assert {k: shipped_messages[k] for k in runtime_messages} == runtime_messages
    assert {k: shipped_methods[k] for k in runtime_methods} == runtime_methods
