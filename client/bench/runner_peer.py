"""An offline peer (vLLM, HF transformers) as a long-lived subprocess speaking runners/protocol.py.

The process loads the model once and then answers one command per run, so repetitions can be
interleaved with the other peers without paying the peer's start-up (vLLM's is about a minute)
again. Its stderr goes to a log file, quoted when it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import tempfile
import time
from pathlib import Path

from client.bench.metrics import RunResult
from client.bench.workload import Request

RUNNERS_DIR = Path(__file__).resolve().parent / "runners"
START_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 6 * 3600.0  # a bound, not an expectation: big workloads on CPU take hours


class PeerUnavailable(Exception):
    """The peer cannot run here (missing venv, import error): reported as skipped."""


class RunnerPeer:
    def __init__(self, name: str, python: str | Path, script: str, spec: dict,
                 env: dict[str, str] | None = None, log_dir: Path | None = None):
        self.name = name
        self.python = str(python)
        self.script = RUNNERS_DIR / script
        self.spec = spec
        self.env = env or {}
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="folio-bench-"))
        self.log_path = self.log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def log_tail(self, num_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""

    def start(self) -> dict:
        if not Path(self.python).exists():
            raise PeerUnavailable(f"no Python at {self.python}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.log_dir / f"{self.name}-spec.json"
        spec_path.write_text(json.dumps(self.spec))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.python, str(self.script), str(spec_path)], env={**os.environ, **self.env},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                start_new_session=True)
        msg = self._receive(START_TIMEOUT_S)
        return {k: v for k, v in msg.items() if k != "event"}

    def run(self, mode: str, requests: list[Request]) -> RunResult:
        cmd = {"cmd": "run", "mode": mode,
               "requests": [{"prompt_ids": r.prompt_ids, "output_len": r.output_len}
                            for r in requests]}
        self._send(cmd)
        return RunResult.from_dict(self._receive(RUN_TIMEOUT_S))

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._send({"cmd": "exit"})
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        # vLLM leaves an engine-core child: end the runner's whole process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, 9)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        self.proc = None

    def _send(self, msg: dict) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _receive(self, timeout: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not sel.select(timeout=max(deadline - time.monotonic(), 0)):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.name}: no answer after {timeout:g} s:\n"
                                       f"{self.log_tail()}")
            line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"{self.name} runner exited with {code}:\n{self.log_tail()}")
        msg = json.loads(line)
        if msg.get("event") == "error":
            raise RuntimeError(f"{self.name}: {msg['message']}\n{self.log_tail()}")
        return msg
