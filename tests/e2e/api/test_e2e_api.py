"""The public API end to end on the tiny random-weight model (`folio:tiny-random`): streaming
text, cancellation, Abort, tokenization and input validation, against one real `folio serve`."""

from __future__ import annotations

import threading

import grpc
import pytest

from client import FolioClient
from protos.folio.v1 import generator_pb2 as pb
from tests.e2e.e2e_util import wait_idle


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture
def client(default_server):
    with FolioClient(default_server.address, timeout=120) as c:
        yield c


def test_model_info_reports_the_tiny_random_model(client, hf_tokenizer):
    info = client.model_info()
    assert info["random_weights"] is True and info["model_name"] == "tiny-random-v2"
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["vocab_size"] == len(hf_tokenizer)
    assert client.health() == "SERVING"


@pytest.mark.parametrize("text", ["Hello, world!", "Déjà vu — naïve café", "東京の桜 😀🎉 ok"])
def test_tokenize_matches_hf(client, hf_tokenizer, text):
    assert client.tokenize(text) == hf_tokenizer(text)["input_ids"]


def test_tokenize_chat_matches_hf_template(client, hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Où est le café? ☕"}]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    assert client.tokenize(messages=messages) == list(expected)


def test_streamed_text_deltas_concatenate_to_the_decoded_output(client, hf_tokenizer):
    # Sampled (seeded) output from random weights wanders through the whole byte-level vocab,
    # so multi-byte characters split across tokens are all but certain in 4 x 48 tokens.
    outputs = []
    for seed in range(4):
        deltas, token_ids = [], []
        for resp in client.generate("日本語とemoji 🎉 and café:", max_tokens=48, seed=seed,
                                    temperature=1.0, ignore_eos=True):
            deltas.append(resp.text)
            token_ids.extend(resp.token_ids)
        assert len(token_ids) == 48
        decoded = hf_tokenizer.decode(token_ids, skip_special_tokens=True)
        assert "".join(deltas) == decoded
        assert len([d for d in deltas if d]) > 1, "text should arrive in several pieces"
        outputs.append(decoded)
    assert any(ord(ch) > 127 for text in outputs for ch in text), outputs


def test_same_seed_same_tokens(client):
    runs = [client.generate_text("Once upon a time", max_tokens=16, seed=7, temperature=0.8,
                                 ignore_eos=True).token_ids for _ in range(2)]
    assert runs[0] == runs[1]


def test_cancelled_stream_frees_its_blocks(client, default_server):
    stream = client.generate("A long story:", max_tokens=1500, ignore_eos=True,
                             request_id="to-cancel")
    first = next(stream)  # the request is running: it holds KV blocks now
    assert first.request_id == "to-cancel"
    stats = client.stats()
    assert stats["num_running"] + stats["num_waiting"] >= 1, stats
    stream.cancel()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(default_server.address)
    assert client.abort("to-cancel") is False  # gone for good


def test_abort_ends_the_stream_with_abort(client, default_server):
    responses = []
    started = threading.Event()

    def consume():
        for resp in client.generate("Abort me", max_tokens=1500, ignore_eos=True,
                                    request_id="to-abort"):
            responses.append(resp)
            started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    try:
        assert started.wait(60), "the request produced nothing"
        assert client.abort("to-abort") is True
    finally:
        reader.join(60)
    assert not reader.is_alive()
    assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT
    completion_tokens = sum(len(r.token_ids) for r in responses)
    assert completion_tokens < 1500
    assert responses[-1].usage.completion_tokens == completion_tokens
    wait_idle(default_server.address)


BAD_REQUESTS = [
    ("no input", pb.GenerateRequest(), "input"),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "empty"),
    ("token id out of range", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 999999])),
     "999999"),
    ("negative temperature",
     pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1.0)), "temperature"),
    ("top_p zero", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0.0)), "top_p"),
    ("top_p above one",
     pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    ("negative top_k", pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_k=-2)),
     "top_k"),
    ("prompt longer than the model",
     pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10] * 5000)), "2048"),
    ("empty chat", pb.GenerateRequest(chat=pb.Chat()), "message"),
]


@pytest.mark.parametrize("name, request_msg, needle", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(client, name, request_msg,
                                                                needle):
    from protos.folio.v1 import generator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(client.address) as channel:
        stub = pb_grpc.GeneratorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request_msg, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    details = err.value.details()
    assert details and needle in details, details
    done = client.generate_text("still there?", max_tokens=3, ignore_eos=True)
    assert done.finish_reason == "length" and len(done.token_ids) == 3


def test_stop_token_ends_the_stream_with_stop(client):
    greedy = client.generate_text("Stop here", max_tokens=16, temperature=0.0,
                                  ignore_eos=True).token_ids
    # The first token not seen before it: generation must end right there.
    k = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    done = client.generate_text("Stop here", max_tokens=16, temperature=0.0, ignore_eos=True,
                                stop_token_ids=[greedy[k]])
    assert done.finish_reason == "stop"
    assert done.token_ids == greedy[:k + 1]


def test_top_k_one_is_greedy(client):
    greedy = client.generate_text("Same either way", max_tokens=12, temperature=0.0,
                                  ignore_eos=True).token_ids
    sampled = client.generate_text("Same either way", max_tokens=12, temperature=1.0, top_k=1,
                                   seed=3, ignore_eos=True).token_ids
    assert sampled == greedy


def test_generation_stops_at_max_model_len(client):
    max_model_len = client.model_info()["max_model_len"]
    prompt = [7 + i % 100 for i in range(max_model_len - 5)]
    done = client.generate_text(token_ids=prompt, max_tokens=100, ignore_eos=True)
    assert done.finish_reason == "length"
    assert done.usage["completion_tokens"] == len(done.token_ids) == 5
