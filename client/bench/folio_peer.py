"""Folio as a benchmark peer: a real `folio serve` on 127.0.0.1, driven through its gRPC stream.

Every mode goes through the public streaming API (`AsyncFolioClient.generate` with prompt token
ids, greedy, ignore_eos, max_tokens = the request's output length), so the numbers include the
gRPC front end, tokenizer-side detokenization and the scheduler/executor channel: what a user
gets. Each response's arrival time is recorded, which gives TTFT, TPOT and ITL per request.

Around every run the server's counters (GetServerStats) are read: steps, and where the server
reports them, executor busy/idle time and scheduler time, from which the executor idle fraction
and the scheduler time per step follow, and speculative decoding's proposals verified and
accepted, whose ratio is the run's acceptance rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from client.bench.metrics import RequestTiming, RunResult
from client.bench.workload import Request

START_TIMEOUT_S = 600.0  # model conversion + torch import on a busy 2-core machine
STOP_TIMEOUT_S = 20.0
# Counters that grow during a run; all but num_steps come from newer servers only.
STEP_COUNTERS = ("num_steps", "executor_busy_s", "executor_idle_s", "scheduler_busy_s",
                 "num_draft_tokens", "num_accepted_tokens")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM a server started in a session of its own, SIGKILL it after STOP_TIMEOUT_S, then
    SIGKILL anything of its process group left behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def step_extras(before: dict, after: dict) -> dict[str, float]:
    """The per-run numbers derived from two GetServerStats answers."""
    delta = {k: after[k] - before[k] for k in STEP_COUNTERS if k in before and k in after}
    out: dict[str, float] = {}
    if "num_steps" in delta:
        out["steps"] = float(delta["num_steps"])
    busy, idle = delta.get("executor_busy_s"), delta.get("executor_idle_s")
    if busy is not None and idle is not None and busy + idle > 0:
        out["executor idle %"] = 100.0 * idle / (busy + idle)
    sched = delta.get("scheduler_busy_s")
    if sched is not None and delta.get("num_steps"):
        out["scheduler ms/step"] = 1e3 * sched / delta["num_steps"]
    # Only a run that speculated has the row (speculation off: no proposals, no row).
    if delta.get("num_draft_tokens"):
        out["spec acceptance (%)"] = (100.0 * delta["num_accepted_tokens"]
                                      / delta["num_draft_tokens"])
    return out


class FolioPeer:
    name = "folio"

    def __init__(self, model: str, serve_args: list[str], env: dict[str, str] | None = None,
                 log_dir: Path | None = None):
        self.model = model
        self.serve_args = serve_args
        self.env = env or {}
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="folio-bench-"))
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.log_path = self.log_dir / "folio-serve.log"

    def log_tail(self, num_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""

    def start(self) -> dict:
        from client.api import FolioClient

        port = free_port()
        self.address = f"127.0.0.1:{port}"
        argv = [sys.executable, "-m", "client.cli", "serve", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(port),
                "--executor-address", f"tcp://127.0.0.1:{free_port()}",
                "--log-level", "warning", *self.serve_args]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # Its own session: stop() can signal the whole process group (scheduler + executor).
            self.proc = subprocess.Popen(argv, env={**os.environ, **self.env},
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        with FolioClient(self.address) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"folio serve exited with {self.proc.returncode}:\n"
                                       f"{self.log_tail()}")
                with contextlib.suppress(Exception):  # grpc errors while the port is not open
                    if client.health(timeout=2.0) == "SERVING":
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"folio serve not SERVING after {START_TIMEOUT_S:g} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.2)
            return {"model_info": client.model_info(), "command": argv[1:]}

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)  # the server stops its executor itself on SIGTERM
        self.proc = None

    def run(self, mode: str, requests: list[Request]) -> RunResult:
        return asyncio.run(self._run(mode, requests))

    async def _run(self, mode: str, requests: list[Request]) -> RunResult:
        from client.aio import AsyncFolioClient

        # Offline modes submit everything at once; serve keeps the Poisson arrival times.
        paced = mode == "serve"
        async with AsyncFolioClient(self.address) as client:
            before = await client.stats()
            start = time.perf_counter()
            timings = await asyncio.gather(*(
                self._one(client, r, start, paced, self.constraint(i))
                for i, r in enumerate(requests)))
            elapsed = time.perf_counter() - start
            after = await client.stats()
        return RunResult(elapsed, list(timings), step_extras(before, after))

    def constraint(self, index: int) -> dict:
        """Structured-output arguments for the request at `index` (none: plain Folio)."""
        return {}

    @staticmethod
    async def _one(client, req: Request, start: float, paced: bool,
                   constraint: dict) -> RequestTiming:
        if paced:
            await asyncio.sleep(max(start + req.arrival_s - time.perf_counter(), 0.0))
        sent = time.perf_counter()
        arrivals: list[float] = []
        output_ids: list[int] = []
        async for resp in client.generate(token_ids=req.prompt_ids, max_tokens=req.output_len,
                                          temperature=0.0, ignore_eos=True, **constraint):
            if resp.token_ids:
                arrivals.append(time.perf_counter())
                output_ids.extend(resp.token_ids)
        if not arrivals:
            raise RuntimeError("Folio returned no token for a request")
        return RequestTiming(prompt_len=req.prompt_len, output_ids=output_ids,
                             ttft_s=arrivals[0] - sent, e2e_s=arrivals[-1] - sent,
                             itl_s=[b - a for a, b in pairwise(arrivals)])


# Constraints that never complete (a JSON array of strings, a run of lowercase words), so with
# EOS ignored every request still makes exactly its output length: the rate compares only the
# cost of the grammar masks.
CONSTRAINTS = (
    {"json_schema": '{"type": "array", "items": {"type": "string"}}'},
    {"regex": r"[a-z ,.]+"},
)


class ConstrainedFolioPeer(FolioPeer):
    """Folio with every other request under structured output, alternately a JSON schema and
    a regex: the issue's "half the requests constrained" workload, next to plain `folio` in the
    same run (its report row `output tok/s vs folio (%)`)."""

    name = "folio-constrained"

    def constraint(self, index: int) -> dict:
        return CONSTRAINTS[(index // 2) % 2] if index % 2 else {}
