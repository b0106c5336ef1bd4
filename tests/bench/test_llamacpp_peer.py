"""The llamacpp peer of `folio bench` (client/bench/llamacpp_peer.py): which file it runs, the
requests it sends, how it reads llama-server's event stream (tokens held back inside a UTF-8
character included), a whole run against a local stand-in server that answers as llama-server
does, and one end-to-end `folio bench latency --peers folio,llamacpp` on the default model with
the real binary (skipped where bench/install_llama_cpp.sh has not built it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from client.bench.llamacpp_peer import (
    DEFAULT_LLAMA_SERVER,
    LlamaCppPeer,
    StreamedTokens,
    completion_body,
    gguf_file,
    parse_event,
    server_argv,
)
from client.bench.metrics import UNSEEN_ID, RequestTiming, RunResult, same_tokens
from client.bench.runner_peer import PeerUnavailable
from client.bench.workload import Request

ROOT = Path(__file__).resolve().parents[2]


def event_line(tokens: list[int], predicted: int, content: str = "x", stop: bool = False) -> str:
    """A /completion stream event as llama-server writes it (fields of its non-OAI answer)."""
    body = {"index": 0, "content": content, "tokens": tokens, "stop": stop, "id_slot": 0,
            "tokens_predicted": predicted, "tokens_evaluated": 5}
    if stop:
        body |= {"stop_type": "limit", "timings": {"predicted_n": predicted}}
    return "data: " + json.dumps(body)


# ---- which file, which command, which request ------------------------------------------------

def test_the_default_model_is_its_gguf_file_and_other_models_are_refused(tmp_path):
    from checkpoints.named_models import SMOLLM2_FILE

    assert gguf_file(None).name == SMOLLM2_FILE
    with pytest.raises(PeerUnavailable, match="GGUF files only"):
        gguf_file("folio:tiny-random")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    with pytest.raises(PeerUnavailable, match="GGUF files only"):
        gguf_file(str(hf_dir))
    with pytest.raises(PeerUnavailable, match="file not found"):
        gguf_file(str(tmp_path / "missing.gguf"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert gguf_file(str(model)) == model
    assert gguf_file(str(tmp_path)) == model  # a directory holding one .gguf file


def test_server_command_has_one_slot_per_stream_and_their_contexts():
    argv = server_argv(Path("/x/llama-server"), Path("/m.gguf"), 8080, slots=16,
                       slot_context=4096, threads=2, max_batch_tokens=2048)
    opts = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert argv[0] == "/x/llama-server"
    assert opts["-m"] == "/m.gguf" and opts["--host"] == "127.0.0.1"
    assert opts["--parallel"] == "16" and opts["-c"] == str(16 * 4096)
    assert opts["--threads"] == opts["--threads-batch"] == "2"
    assert "--cont-batching" in argv and "--no-kv-unified" in argv
    assert argv[argv.index("--cache-ram") + 1] == "0"
    assert server_argv(Path("/x"), Path("/m"), 1, 1, 256, 1, 256, ["--poll", "0"])[-2:] == [
        "--poll", "0"]


def test_make_peer_sizes_the_slots_and_refuses_random_models(tmp_path):
    from client.bench.cli import build_parser
    from client.bench.peers import make_peer

    def peer(*argv: str):
        args = build_parser().parse_args([*argv, "--peers", "llamacpp"])
        return make_peer("llamacpp", args, "", tmp_path, 1024, 0, tmp_path)

    throughput = peer("throughput", "--num-prompts", "300", "--threads", "3")
    assert throughput.gguf == gguf_file(None)
    assert throughput.slots == 256  # --max-num-seqs
    assert throughput.slot_context == 1024 and throughput.threads == 3
    assert peer("latency", "--batch-size", "4").slots == 4
    assert peer("throughput").slots == 16
    assert peer("throughput", "--llama-arg=--poll", "--llama-arg=0").extra_args == ["--poll",
                                                                                   "0"]
    with pytest.raises(PeerUnavailable, match="GGUF files only"):
        peer("throughput", "--random-model", "smollm2-135m")


def test_completion_request_is_greedy_uncached_streamed_on_the_prompt_ids():
    body = completion_body(Request(prompt_ids=[5, 6, 7], output_len=9, arrival_s=0.0))
    assert body["prompt"] == [5, 6, 7]  # a token array: llama-server adds no BOS to it
    assert body["n_predict"] == 9
    assert body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["ignore_eos"] is True and body["cache_prompt"] is False
    assert body["stream"] is True


def test_missing_binary_is_skipped_with_the_install_hint(tmp_path):
    peer = LlamaCppPeer(tmp_path / "none" / "llama-server", tmp_path / "m.gguf", 1, 256, 1, 256,
                        tmp_path)
    with pytest.raises(PeerUnavailable, match="install_llama_cpp.sh"):
        peer.start()


# ---- the event stream -------------------------------------------------------------------------

def test_parse_event_reads_data_lines_and_refuses_errors():
    assert parse_event(event_line([42], 1))["tokens"] == [42]
    assert parse_event("") is None and parse_event(": keep-alive") is None
    assert parse_event("data: [DONE]") is None
    with pytest.raises(RuntimeError, match="context size"):
        parse_event('error: {"code": 400, "message": "prompt exceeds the context size"}')
    with pytest.raises(RuntimeError, match="bad"):
        parse_event('data: {"error": {"message": "bad"}}')


def test_streamed_tokens_count_the_ones_held_back_inside_a_utf8_character():
    tokens = StreamedTokens()
    lines = [event_line([10], 1), event_line([11], 2),
             event_line([13], 4, "é"),  # token 12 ended inside the character: held back
             event_line([14], 5),
             event_line([], 6, "", stop=True)]  # the last one held back, then the final event
    for at, line in enumerate(lines):
        tokens.add(parse_event(line), float(at))
    assert tokens.ids == [10, 11, UNSEEN_ID, 13, 14, UNSEEN_ID]
    assert tokens.unseen == 2
    assert tokens.arrivals == [0.0, 1.0, 2.0, 3.0, 4.0]
    timing = tokens.timing(Request([1, 2], 6, 0.0), sent=-0.5)
    assert timing.num_output == 6
    assert timing.ttft_s == 0.5 and timing.e2e_s == 4.5
    assert timing.itl_s == [1.0, 1.0, 1.0, 1.0]
    assert timing.tpot_s == pytest.approx(4.0 / 5)


def test_a_final_event_alone_adds_no_arrival():
    tokens = StreamedTokens()
    tokens.add(parse_event(event_line([7], 1)), 0.1)
    tokens.add(parse_event(event_line([], 1, "", stop=True)), 0.2)
    assert tokens.ids == [7] and tokens.arrivals == [0.1]
    with pytest.raises(RuntimeError, match="no token"):
        StreamedTokens().timing(Request([1], 1, 0.0), 0.0)


def test_unseen_ids_match_any_id_but_lengths_must_agree():
    def run(*outputs: list[int]) -> RunResult:
        return RunResult(1.0, [RequestTiming(prompt_len=1, output_ids=o) for o in outputs])

    reference = run([1, 2, 3], [4, 5, 6])
    assert same_tokens(run([1, UNSEEN_ID, 3], [4, 5, 6]), reference) == 1.0
    assert same_tokens(run([1, UNSEEN_ID, 9], [4, 5, 6]), reference) == 0.5
    assert same_tokens(run([1, 2], [4, 5, 6, 7]), reference) == 0.0


# ---- a whole run against a stand-in server -----------------------------------------------------

class FakeLlamaServer(BaseHTTPRequestHandler):
    """/completion as llama-server streams it: one event per token (the token id is the
    prompt's last id + position), a final event with stop, then the connection closes. Every
    request body is kept for the test; a prompt holding 0 gets llama-server's 400 answer."""

    bodies: list[dict] = []
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.bodies.append(body)
        if 0 in body["prompt"]:
            payload = json.dumps({"error": {"code": 400, "message": "invalid token"}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n, last = body["n_predict"], body["prompt"][-1]
        for i in range(n):
            self.wfile.write((event_line([last + i], i + 1) + "\n\n").encode())
            self.wfile.flush()
        self.wfile.write((event_line([], n, "", stop=True) + "\n\n").encode())


@pytest.fixture
def fake_server():
    FakeLlamaServer.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeLlamaServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def peer_at(url: str, tmp_path: Path) -> LlamaCppPeer:
    peer = LlamaCppPeer(DEFAULT_LLAMA_SERVER, tmp_path / "m.gguf", 4, 256, 1, 256, tmp_path)
    peer.url = url
    return peer


def test_a_run_sends_every_request_and_times_every_token(fake_server, tmp_path):
    requests = [Request([3, 4, 100 * (i + 1)], output_len=5 + i, arrival_s=0.0)
                for i in range(4)]
    run = peer_at(fake_server, tmp_path).run("throughput", requests)
    assert sorted(b["prompt"][-1] for b in FakeLlamaServer.bodies) == [100, 200, 300, 400]
    assert all(b["stream"] and not b["cache_prompt"] for b in FakeLlamaServer.bodies)
    assert [t.output_ids for t in run.requests] == [
        list(range(r.prompt_ids[-1], r.prompt_ids[-1] + r.output_len)) for r in requests]
    for timing in run.requests:
        assert 0 < timing.ttft_s <= timing.e2e_s <= run.elapsed_s
        assert len(timing.itl_s) == timing.num_output - 1
    assert run.extra == {"ids not streamed": 0.0}


def test_serve_mode_keeps_the_arrival_times(fake_server, tmp_path):
    requests = [Request([1, 10], 2, 0.0), Request([1, 20], 2, 0.3)]
    run = peer_at(fake_server, tmp_path).run("serve", requests)
    assert run.elapsed_s >= 0.3
    assert [t.num_output for t in run.requests] == [2, 2]


def test_an_error_answer_fails_the_run_with_its_message(fake_server, tmp_path):
    with pytest.raises(RuntimeError, match="400.*invalid token"):
        peer_at(fake_server, tmp_path).run("latency", [Request([0, 1], 2, 0.0)])


# ---- the real command with the real llama-server ----------------------------------------------

@pytest.mark.e2e
@pytest.mark.skipif(not DEFAULT_LLAMA_SERVER.is_file(),
                    reason=f"no llama-server at {DEFAULT_LLAMA_SERVER} "
                    "(bench/install_llama_cpp.sh builds it)")
def test_latency_end_to_end_with_folio_and_llamacpp(tmp_path, folio_cache_dir):
    batch, input_len, output_len = 2, 16, 8
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "client.cli", "bench", "latency", "--batch-size", str(batch),
           "--input-len", str(input_len), "--output-len", str(output_len), "--reps", "1",
           "--peers", "folio,llamacpp", "--out", str(out), "--name", "llamacpp-smoke"]
    env = {**os.environ, "FOLIO_CACHE_DIR": str(folio_cache_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]

    result = json.loads(next(out.glob("*-llamacpp-smoke.json")).read_text())
    assert set(result["summary"]) == {"folio", "llamacpp"}, result["skipped"]
    info = result["peers"]["llamacpp"]
    assert Path(info["gguf"]).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "commit" in info["version"]
    assert "GGML_NATIVE=ON" in info["build"]
    # Folio serves the converted checkpoint of that very file, its blocks kept quantized.
    folio_config = json.loads((Path(result["model"]["folio_model"]) / "config.json").read_text())
    assert folio_config["quantization_config"]["quant_method"] == "gguf"
    for peer, metrics in result["summary"].items():
        assert metrics["output tokens"]["median"] == batch * output_len, peer
        assert metrics["TPOT p50 (ms)"]["median"] > 0, peer
        (run,) = result["runs"][peer]
        assert [r["num_output"] for r in run["requests"]] == [output_len] * batch
    llama = result["summary"]["llamacpp"]
    assert 0 <= llama["same tokens as folio (%)"]["median"] <= 100
    assert llama["ids not streamed"]["median"] >= 0
    table = next(out.glob("*-llamacpp-smoke.md")).read_text()
    assert f"({result['machine']['isa']})" in table  # the result names the ISA
    assert "folio / llamacpp" in table.splitlines()[next(
        i for i, x in enumerate(table.splitlines()) if x.startswith("| metric"))]
    assert f"- llamacpp: llama.cpp {info['version']}" in table
