"""The vLLM worker contract (vllm.grpc.engine.VllmEngine) of a real `folio serve` (the tiny
random model), every RPC called through the contract's own generated stubs (smg-grpc-proto).

Oracles: Folio's own API on the same port (folio.v1.Generator: greedy tokens, model facts,
server stats, prefix-cache counters), the tokenizer files the contract itself streams, and the
KV-event block hashes computed here from the prompt as docs/architecture.md defines them.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import struct
import threading
import time
import zipfile

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2

from client import FolioClient
from protos.folio.v1 import generator_pb2 as pb
from protos.folio.v1 import generator_pb2_grpc as pb_grpc
from tests.e2e.e2e_util import wait_idle

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(10, 42))  # 32 token ids
# Every RPC of the contract; test_every_rpc_is_covered fails when the pinned package grows one.
EXERCISED = {"Generate", "Embed", "HealthCheck", "FlushCache", "StartProfile", "StopProfile",
             "Abort", "GetModelInfo", "GetServerInfo", "GetLoads", "GetTokenizer",
             "SubscribeKvEvents"}


@pytest.fixture(scope="module")
def channel(default_server):
    with grpc.insecure_channel(default_server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def vllm(channel) -> vpb_grpc.VllmEngineStub:
    return vpb_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def folio(channel) -> pb_grpc.GeneratorStub:
    return pb_grpc.GeneratorStub(channel)


def generate(vllm, ids=PROMPT, stream=True, **sampling) -> list:
    request = vpb.GenerateRequest(request_id=sampling.pop("request_id", ""),
                                  tokenized=vpb.TokenizedInput(input_ids=ids),
                                  sampling_params=vpb.SamplingParams(**sampling), stream=stream)
    return list(vllm.Generate(request, timeout=120))


def folio_greedy(folio, ids, max_tokens) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [t for r in folio.Generate(request, timeout=120) for t in r.token_ids]


def split(responses) -> tuple[list, list]:
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    return chunks, completes


def test_every_rpc_is_covered():
    assert {m.name for m in vpb.DESCRIPTOR.services_by_name["VllmEngine"].methods} == EXERCISED


def test_health_check(vllm):
    response = vllm.HealthCheck(vpb.HealthCheckRequest(), timeout=10)
    assert response.healthy and response.message


def test_model_info_matches_folio_and_tokenizer_files(vllm, folio):
    info = vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
    folio_info = folio.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    files = tokenizer_files(vllm)
    config = json.loads(files["config.json"])
    assert info.served_model_name == info.model_path == folio_info.model_name
    assert info.max_context_length == info.max_req_input_len == folio_info.max_model_len
    assert info.vocab_size == folio_info.vocab_size
    assert list(info.architectures) == [folio_info.architecture] == config["architectures"]
    assert info.model_type == config["model_type"]
    assert info.is_generation and not info.supports_vision
    assert info.tokenizer_path == ""  # never a server path: GetTokenizer carries the files
    eos = config.get("eos_token_id")
    gen = json.loads(files.get("generation_config.json", "{}")).get("eos_token_id")
    expected = {i for v in (eos, gen) if v is not None for i in ([v] if isinstance(v, int) else v)}
    assert set(info.eos_token_ids) == expected


def tokenizer_files(vllm) -> dict[str, str]:
    chunks = list(vllm.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert all(len(c.data) <= 64 * 1024 for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {name: zf.read(name).decode() for name in zf.namelist()}


def test_tokenizer_zip_rebuilds_folios_tokenizer(vllm, folio):
    from tokenizers import Tokenizer

    files = tokenizer_files(vllm)
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    rebuilt = Tokenizer.from_str(files["tokenizer.json"])
    text = "Hello, world: the gateway rebuilds this tokenizer."
    expected = folio.Tokenize(pb.TokenizeRequest(text=text), timeout=10).token_ids
    assert rebuilt.encode(text).ids == list(expected)


def test_streamed_generate_matches_folio_greedy(vllm, folio):
    chunks, completes = split(generate(vllm, temperature=0.0, max_tokens=12, ignore_eos=True))
    expected = folio_greedy(folio, PROMPT, 12)
    assert [t for c in chunks for t in c.token_ids] == expected
    assert [c.completion_tokens for c in chunks] == [
        sum(len(x.token_ids) for x in chunks[:i + 1]) for i in range(len(chunks))]
    assert all(c.prompt_tokens == len(PROMPT) and c.index == 0 for c in chunks)
    (done,) = completes
    assert list(done.output_ids) == expected
    assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == (
        "length", 12, len(PROMPT))
    assert done.WhichOneof("matched_stop") is None


def test_unstreamed_generate_is_one_complete_per_index(vllm, folio):
    responses = generate(vllm, stream=False, temperature=0.0, max_tokens=6, ignore_eos=True,
                         n=2)
    chunks, completes = split(responses)
    assert chunks == [] and sorted(c.index for c in completes) == [0, 1]
    expected = folio_greedy(folio, PROMPT, 6)
    assert all(list(c.output_ids) == expected and c.completion_tokens == 6 for c in completes)


def test_stop_token_and_stop_string(vllm, folio):
    expected = folio_greedy(folio, PROMPT, 8)
    stop_id = expected[3]
    (done,) = split(generate(vllm, stream=False, temperature=0.0, max_tokens=8,
                             ignore_eos=True, stop_token_ids=[stop_id]))[1]
    assert done.finish_reason == "stop" and done.matched_token_id == stop_id
    assert list(done.output_ids) == expected[:expected.index(stop_id) + 1]


def test_logprobs_and_prompt_logprobs(vllm):
    chunks, completes = split(generate(vllm, temperature=0.0, max_tokens=5, ignore_eos=True,
                                       logprobs=2, prompt_logprobs=1))
    out_ids = [t for c in chunks for t in c.token_ids]
    assert [t for c in chunks for t in c.output_logprobs.token_ids] == out_ids
    tops = [t for c in chunks for t in c.output_logprobs.top_logprobs]
    assert len(tops) == len(out_ids) and all(len(t.token_ids) == len(t.values) == 2 for t in tops)
    # greedy: the sampled token is the most likely one
    assert [t.token_ids[0] for t in tops] == out_ids
    inputs = [c.input_logprobs for c in chunks if c.HasField("input_logprobs")]
    assert len(inputs) == 1 and chunks[0].HasField("input_logprobs")
    assert list(inputs[0].token_ids) == PROMPT
    assert [e.HasField("value") for e in inputs[0].token_logprobs] == [False] + [True] * 31
    (done,) = split(generate(vllm, stream=False, temperature=0.0, max_tokens=5,
                             ignore_eos=True, logprobs=0))[1]
    assert list(done.output_logprobs.token_ids) == list(done.output_ids)
    assert len(done.output_logprobs.top_logprobs) == 0  # 0 alternatives: the tokens' own only


def test_cached_tokens_count_the_prefix_cache(vllm):
    ids = list(range(100, 180))
    first = split(generate(vllm, ids, stream=False, temperature=0.0, max_tokens=2))[1][0]
    second = split(generate(vllm, ids, stream=False, temperature=0.0, max_tokens=2))[1][0]
    assert first.cached_tokens == 0 < second.cached_tokens < len(ids)


def test_choice_constraint(vllm, folio):
    choices = ["yes please", "no thanks"]
    (done,) = split(generate(vllm, stream=False, max_tokens=16, seed=3,
                             choice=vpb.ChoiceConstraint(choices=choices)))[1]
    from tokenizers import Tokenizer

    text = Tokenizer.from_str(tokenizer_files(vllm)["tokenizer.json"]).decode(
        list(done.output_ids), skip_special_tokens=True)
    assert done.finish_reason == "stop" and text in choices


def test_abort_ends_the_stream_and_frees_its_blocks(vllm, default_server):
    request = vpb.GenerateRequest(
        request_id="contract-abort", tokenized=vpb.TokenizedInput(input_ids=PROMPT),
        sampling_params=vpb.SamplingParams(max_tokens=4000, ignore_eos=True), stream=True)
    stream = vllm.Generate(request, timeout=120)
    first = next(stream)
    assert first.chunk.token_ids
    loads = vllm.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
    assert loads.num_running_reqs + loads.num_waiting_reqs == 1 and loads.num_used_tokens > 0
    vllm.Abort(vpb.AbortRequest(request_ids=["contract-abort", "no-such-request"]), timeout=10)
    rest = list(stream)
    assert rest[-1].complete.finish_reason == "abort"
    wait_idle(default_server.address)
    loads = vllm.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
    assert (loads.num_running_reqs, loads.num_used_tokens, loads.token_usage) == (0, 0, 0.0)


def _long_stream(vllm):
    """A streamed request far from its end, its first chunk already read."""
    request = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=PROMPT),
                                  sampling_params=vpb.SamplingParams(max_tokens=4000,
                                                                     ignore_eos=True),
                                  stream=True)
    stream = vllm.Generate(request, timeout=120)
    next(stream)
    return stream


def test_cancelled_stream_frees_its_blocks(vllm, default_server):
    stream = _long_stream(vllm)
    stream.cancel()
    wait_idle(default_server.address)


def test_server_info_and_loads(vllm, folio):
    folio_info = folio.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    info = vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert info.server_type == "folio-grpc" and info.uptime_seconds > 0
    assert info.data_parallel_size == 1 and info.max_num_seqs > 0
    assert info.block_size == folio_info.block_size and info.model_dtype == folio_info.dtype
    # --kv-cache-dtype auto: the KV cache holds the model's dtype.
    assert info.kv_cache_dtype == folio_info.kv_cache_dtype == folio_info.dtype
    response = vllm.GetLoads(vpb.GetLoadsRequest(), timeout=10)
    assert response.dp_rank_count == 1 and response.timestamp
    (load,) = response.loads
    stats = folio.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    assert load.max_total_num_tokens == stats.kv_blocks_total * folio_info.block_size
    assert load.max_running_requests == info.max_num_seqs
    assert load.cache_hit_rate == pytest.approx(stats.prefix_cache_hit_rate)
    assert not vllm.GetLoads(vpb.GetLoadsRequest(dp_rank=3), timeout=10).loads


def test_loads_count_a_running_request(vllm, default_server):
    stream = _long_stream(vllm)
    load = vllm.GetLoads(vpb.GetLoadsRequest(), timeout=10).loads[0]
    stream.cancel()
    assert load.num_running_reqs == 1 and load.num_waiting_reqs == 0
    assert 0 < load.token_usage <= 1 and load.num_used_tokens >= len(PROMPT)
    wait_idle(default_server.address)


@pytest.mark.parametrize("call, request_msg", [
    ("Embed", vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2]))),
    ("StartProfile", common_pb2.StartProfileRequest()),
    ("StopProfile", common_pb2.StopProfileRequest()),
])
def test_unsupported_rpcs_say_so(vllm, call, request_msg):
    with pytest.raises(grpc.RpcError) as e:
        getattr(vllm, call)(request_msg, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Folio" in e.value.details()


class Subscriber:
    """A SubscribeKvEvents stream read on a thread into the view a gateway keeps: block hash
    -> token ids, applied event by event."""

    def __init__(self, vllm):
        self.call = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=300)
        self.batches: list = []
        self.view: dict[int, tuple[int, ...]] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for batch in self.call:
                for event in batch.events:
                    match event.WhichOneof("data"):
                        case "stored":
                            for block in event.stored.blocks:
                                self.view[block.block_hash] = tuple(block.token_ids)
                        case "removed":
                            for h in event.removed.block_hashes:
                                self.view.pop(h, None)
                        case "cleared":
                            self.view.clear()
                self.batches.append(batch)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e

    def until(self, predicate, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not predicate(self):
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"not seen in {timeout}s: {len(self.view)}"
            time.sleep(0.02)

    def close(self):
        self.call.cancel()
        self.thread.join(10)


def block_hashes(ids, block_size, salt=""):
    """The hashes a prompt's full blocks are published under, as docs/architecture.md states
    them: key(k) = sha256(key(k-1) | u32 len(salt) | salt | u32 n | n x u32 token ids), little
    endian (key(-1) empty); on the wire the signed big-endian int64 of a key's first 8 bytes."""
    hashes, parent = [], b""
    salt_bytes = salt.encode()
    for k in range(len(ids) // block_size):
        block = ids[k * block_size:(k + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack("<I", len(salt_bytes)) + salt_bytes
                                + struct.pack(f"<I{len(block)}I", len(block), *block)).digest()
        hashes.append(int.from_bytes(parent[:8], "big", signed=True))
    return hashes


def prefix_hits(folio) -> int:
    return folio.GetServerStats(pb.GetServerStatsRequest(), timeout=10).prefix_cache_hits


def salted_greedy(folio, ids, salt=""):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), cache_salt=salt,
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=2))
    return list(folio.Generate(request, timeout=120))


@pytest.fixture
def subscriber(vllm):
    sub = Subscriber(vllm)
    sub.until(lambda s: s.batches)  # the snapshot is in
    yield sub
    sub.close()


def test_kv_events_publish_the_prompts_blocks(vllm, folio, subscriber):
    block_size = vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10).block_size
    snapshot = subscriber.batches[0]
    assert snapshot.snapshot.count >= 1 and snapshot.events[0].HasField("cleared")
    ids = [random.Random(1).randrange(100, 400) for _ in range(3 * block_size + 5)]
    generate(vllm, ids, stream=False, temperature=0.0, max_tokens=2)
    expected = block_hashes(ids, block_size)
    subscriber.until(lambda s: set(expected) <= set(s.view))
    for k, h in enumerate(expected):
        assert subscriber.view[h] == tuple(ids[k * block_size:(k + 1) * block_size])
    numbers = [b.sequence_number for b in subscriber.batches]
    assert numbers == list(range(1, len(numbers) + 1))


def test_flush_cache_then_the_same_prompt_has_no_hits(vllm, folio, default_server, subscriber):
    ids = [random.Random(2).randrange(100, 400) for _ in range(40)]
    salted_greedy(folio, ids)
    hits = prefix_hits(folio)
    salted_greedy(folio, ids)
    assert prefix_hits(folio) > hits  # cached
    wait_idle(default_server.address)
    response = vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10), timeout=30)
    assert response.success, response.message
    subscriber.until(lambda s: s.batches[-1].events[-1].HasField("cleared") and not s.view)
    hits = prefix_hits(folio)
    salted_greedy(folio, ids)
    assert prefix_hits(folio) == hits  # nothing left to hit
    salted_greedy(folio, ids)
    assert prefix_hits(folio) > hits  # cached again


def test_cache_salt_separates_tenants(folio):
    ids = [random.Random(3).randrange(100, 400) for _ in range(40)]
    salted_greedy(folio, ids, salt="tenant-a")
    hits = prefix_hits(folio)
    salted_greedy(folio, ids, salt="tenant-b")
    salted_greedy(folio, ids)  # no salt: its own namespace
    assert prefix_hits(folio) == hits
    salted_greedy(folio, ids, salt="tenant-a")
    assert prefix_hits(folio) > hits


def test_cache_salt_over_the_limit_is_refused(folio):
    with pytest.raises(grpc.RpcError) as e:
        salted_greedy(folio, [1, 2, 3], salt="ü" * 200)  # 400 bytes of UTF-8
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt may have at most 256 bytes" in e.value.details()


@pytest.mark.parametrize("fields, code, words", [
    (dict(structural_tag="{}"), grpc.StatusCode.UNIMPLEMENTED, "structural_tag"),
    (dict(logprobs=-1), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    (dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (dict(seed=-5), grpc.StatusCode.INVALID_ARGUMENT, "seed"),
    (dict(truncate_prompt_tokens=0), grpc.StatusCode.INVALID_ARGUMENT,
     "truncate_prompt_tokens"),
    (dict(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(regex="("), grpc.StatusCode.INVALID_ARGUMENT, "regex"),
])
def test_refusals(vllm, fields, code, words):
    with pytest.raises(grpc.RpcError) as e:
        generate(vllm, max_tokens=fields.pop("max_tokens", 4), **fields)
    assert e.value.code() == code and words in e.value.details()


def test_request_level_refusals(vllm, channel):
    multimodal = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2]),
                                     mm_inputs=vpb.MultimodalInputs(mm_hashes=["x"]))
    with pytest.raises(grpc.RpcError) as e:
        list(vllm.Generate(multimodal, timeout=10))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as e:
        list(vllm.Generate(vpb.GenerateRequest(), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input" in e.value.details()
    raw = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate")
    with pytest.raises(grpc.RpcError) as e:
        list(raw(b"\x0a\x02\xff\xfe", timeout=10))  # request_id: invalid UTF-8
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vllm_engine.proto" in e.value.details()


def test_truncate_prompt_tokens_keeps_the_last_tokens(vllm, folio):
    (done,) = split(generate(vllm, stream=False, temperature=0.0, max_tokens=4,
                             ignore_eos=True, truncate_prompt_tokens=8))[1]
    assert done.prompt_tokens == 8
    assert list(done.output_ids) == folio_greedy(folio, PROMPT[-8:], 4)


def test_text_input(vllm):
    request = vpb.GenerateRequest(text="Hello there", sampling_params=vpb.SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True))
    (done,) = split(list(vllm.Generate(request, timeout=60)))[1]
    assert done.prompt_tokens > 0 and len(done.output_ids) == 3


def test_folio_api_still_served(default_server):
    with FolioClient(default_server.address, timeout=30) as client:
        assert client.health() == "SERVING"
