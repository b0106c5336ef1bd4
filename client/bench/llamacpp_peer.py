"""llama.cpp's `llama-server` as a benchmark peer: the GGUF file Folio serves, driven over HTTP.

llama.cpp is what users run GGUF files with on a CPU (Ollama's engine), so on a GGUF model
`folio bench --peers folio,llamacpp` puts Folio next to it. The server is built by
bench/install_llama_cpp.sh (PREFIX/bin/llama-server, default .llama-cpp at the repository
root) and started here once per `folio bench` run:

    llama-server -m FILE.gguf --host 127.0.0.1 --port P --parallel N --cont-batching
                 --no-kv-unified -c N*max_model_len --threads T --threads-batch T
                 --batch-size max_num_batched_tokens --cache-ram 0 [--llama-arg ...]

N slots (at most --max-num-seqs; as many as the run's requests), each with the context every
peer gets; continuous batching on; T = --threads or every usable core, as Folio's executor.
llama-server's own warm-up at load is kept (it is start-up time, never timed).

Every request goes to its native /completion endpoint with the workload's prompt token ids as
`prompt` (a token array: no BOS is added, so the model sees exactly Folio's ids), `n_predict` =
the output length, greedy (temperature 0, top_k 1), `ignore_eos`, and `cache_prompt: false`,
so no repetition reuses an earlier prompt's KV (the workload's prompts differ across
repetitions anyway). It streams (server-sent events): each event carries one token id, and its
arrival time gives TTFT, TPOT and ITL as for Folio's gRPC stream. Offline modes send every
request at once; serve keeps the Poisson arrival times.

A token whose text ends inside a UTF-8 character is not streamed on its own: llama-server holds
it back and sends the text with the next complete token's event, which carries only that
token's id. Each event also says how many tokens the request has generated
(`tokens_predicted`), so the held-back tokens are counted (arriving with that event) and their
ids recorded as UNSEEN_ID; `same tokens as folio (%)` matches an unseen id with any id, and
the run's `ids not streamed` row says how many there were.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from itertools import pairwise
from pathlib import Path

from client.bench.folio_peer import free_port, stop_server
from client.bench.metrics import UNSEEN_ID, RequestTiming, RunResult
from client.bench.runner_peer import PeerUnavailable
from client.bench.workload import Request

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LLAMA_SERVER = REPO_ROOT / ".llama-cpp" / "bin" / "llama-server"
INSTALL_HINT = "run bench/install_llama_cpp.sh"
START_TIMEOUT_S = 300.0


def gguf_file(model: str | None) -> Path:
    """The GGUF file behind a `folio serve --model` value (None: Folio's default model), or
    PeerUnavailable: llama.cpp reads GGUF files only."""
    from checkpoints import named_models
    from checkpoints.gguf import find_gguf_file

    if model is None:
        try:
            return named_models.smollm2_gguf()
        except ValueError as e:
            raise PeerUnavailable(str(e)) from None
    try:
        found = None if named_models.is_named(model) else find_gguf_file(model)
    except ValueError as e:  # a missing .gguf path, a directory with several
        raise PeerUnavailable(str(e)) from None
    if found is None:
        raise PeerUnavailable(f"llama.cpp runs GGUF files only; --model {model!r} is not one "
                              "(give a .gguf file, or leave --model out for the default model)")
    return found


def server_argv(binary: Path, gguf: Path, port: int, slots: int, slot_context: int,
                threads: int, max_batch_tokens: int, extra: list[str] = ()) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--cont-batching", "--no-kv-unified",
            "-c", str(slots * slot_context), "--threads", str(threads),
            "--threads-batch", str(threads), "--batch-size", str(max_batch_tokens),
            "--cache-ram", "0", *extra]


def completion_body(req: Request) -> dict:
    """The /completion request for `req`: its ids, its length, greedy, EOS ignored, uncached,
    streamed."""
    return {"prompt": list(req.prompt_ids), "n_predict": req.output_len, "stream": True,
            "temperature": 0.0, "top_k": 1, "ignore_eos": True, "cache_prompt": False,
            "return_tokens": True}


def parse_event(line: str) -> dict | None:
    """One line of llama-server's event stream: the event's JSON, None for a line that is no
    event (blank separators, comments, `data: [DONE]`); a RuntimeError for an error event."""
    line = line.strip()
    if line.startswith("error:"):
        raise RuntimeError(f"llama-server: {line[len('error:'):].strip()}")
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return None
    event = json.loads(payload)
    if "error" in event:
        raise RuntimeError(f"llama-server: {event['error']}")
    return event


class StreamedTokens:
    """A request's output ids and their arrival times, from its events in order."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.arrivals: list[float] = []  # one per event that brought tokens
        self.unseen = 0

    def add(self, event: dict, at: float) -> None:
        ids = [int(t) for t in event.get("tokens") or []]
        total = event.get("tokens_predicted")
        # Tokens held back with a partial UTF-8 character count in tokens_predicted only.
        missing = max(int(total) - len(self.ids) - len(ids), 0) if total is not None else 0
        if not ids and not missing:
            return
        self.unseen += missing
        self.ids += [UNSEEN_ID] * missing + ids
        self.arrivals.append(at)

    def timing(self, req: Request, sent: float) -> RequestTiming:
        if not self.arrivals:
            raise RuntimeError("llama-server returned no token for a request")
        return RequestTiming(prompt_len=req.prompt_len, output_ids=self.ids,
                             ttft_s=self.arrivals[0] - sent, e2e_s=self.arrivals[-1] - sent,
                             itl_s=[b - a for a, b in pairwise(self.arrivals)])


class LlamaCppPeer:
    name = "llamacpp"

    def __init__(self, binary: str | Path, gguf: Path, slots: int, slot_context: int,
                 threads: int, max_batch_tokens: int, log_dir: Path | None = None,
                 extra_args: list[str] = ()):
        self.binary = Path(binary)
        self.gguf = gguf
        self.slots = slots
        self.slot_context = slot_context
        self.threads = threads
        self.max_batch_tokens = max_batch_tokens
        self.extra_args = list(extra_args)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="folio-bench-"))
        self.log_path = self.log_dir / "llama-server.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def log_tail(self, num_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""

    def version(self) -> str:
        done = subprocess.run([str(self.binary), "--version"], capture_output=True, text=True,
                              timeout=60)
        lines = (done.stdout + done.stderr).strip().splitlines()
        line = next((x for x in lines if x.startswith("version:")), lines[0] if lines else "?")
        return line.removeprefix("version:").strip()

    def start(self) -> dict:
        if not self.binary.is_file():
            raise PeerUnavailable(f"no llama-server at {self.binary} ({INSTALL_HINT})")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = server_argv(self.binary, self.gguf, port, self.slots, self.slot_context,
                           self.threads, self.max_batch_tokens, self.extra_args)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not healthy after {START_TIMEOUT_S:g} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)
        return {"command": argv, "version": self.version(), "gguf": str(self.gguf),
                "build": self.build_facts()}

    def build_facts(self) -> str:
        """What bench/install_llama_cpp.sh recorded beside the binary (commit, flags, CPU)."""
        with contextlib.suppress(OSError):
            return (self.binary.parent.parent / "VERSION").read_text().strip()
        return ""

    def _healthy(self) -> bool:
        try:  # 503 while the model loads, refused before the port opens
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)
        self.proc = None

    def run(self, mode: str, requests: list[Request]) -> RunResult:
        return asyncio.run(self._run(mode, requests))

    async def _run(self, mode: str, requests: list[Request]) -> RunResult:
        import httpx2

        paced = mode == "serve"
        limits = httpx2.Limits(max_connections=len(requests),
                               max_keepalive_connections=len(requests))
        async with httpx2.AsyncClient(base_url=self.url, timeout=None, limits=limits) as client:
            start = time.perf_counter()
            streams = await asyncio.gather(*(self._one(client, r, start, paced)
                                             for r in requests))
            elapsed = time.perf_counter() - start
        timings = [t for t, _ in streams]
        return RunResult(elapsed, timings, {"ids not streamed": float(sum(u for _, u in streams))})

    @staticmethod
    async def _one(client, req: Request, start: float,
                   paced: bool) -> tuple[RequestTiming, int]:
        if paced:
            await asyncio.sleep(max(start + req.arrival_s - time.perf_counter(), 0.0))
        sent = time.perf_counter()
        tokens = StreamedTokens()
        async with client.stream("POST", "/completion", json=completion_body(req)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"llama-server answered {resp.status_code}: {body[:500]}")
            async for line in resp.aiter_lines():
                event = parse_event(line)
                if event is not None:
                    tokens.add(event, time.perf_counter())
        return tokens.timing(req, sent), tokens.unseen
