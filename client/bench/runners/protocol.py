"""The line protocol between `folio bench` and a peer runner (stdlib only: it runs in the peer's
own Python, e.g. the vLLM venv, where Folio is not installed).

    folio bench                          runner (python RUNNER.py SPEC.json)
                                   <-    {"event": "ready", "versions": {...}, ...}
    {"cmd": "run", "mode": ..., "requests": [{"prompt_ids": [...], "output_len": n}]}
                                   ->
                                   <-    {"event": "result", "elapsed_s": ..., "requests": [...]}
    {"cmd": "exit"}                ->
    (any failure)                  <-    {"event": "error", "message": "..."}, exit 1

The protocol owns the runner's real stdout; everything else the runner or its libraries print
goes to stderr (fd 1 is pointed there), so log lines never corrupt a message.

A runner supplies `load(spec) -> (state, info)` and `generate(state, prompts, output_lens) ->
output ids per request`; the modes are built from timed `generate` calls here:

    throughput  one call over all requests
    latency     one call with one output token each (its wall time is every request's TTFT),
                then the full call (its wall time is every request's e2e)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

Generate = Callable[[Any, list[list[int]], list[int]], list[list[int]]]


def _timed(generate: Generate, state: Any, prompts: list[list[int]], lens: list[int]):
    start = time.perf_counter()
    outputs = generate(state, prompts, lens)
    return time.perf_counter() - start, outputs


def run_command(cmd: dict, generate: Generate, state: Any) -> dict:
    prompts = [r["prompt_ids"] for r in cmd["requests"]]
    lens = [r["output_len"] for r in cmd["requests"]]
    ttft_s = None
    if cmd["mode"] == "latency":
        ttft_s, _ = _timed(generate, state, prompts, [1] * len(prompts))
    elif cmd["mode"] != "throughput":
        raise ValueError(f"an offline runner has no {cmd['mode']!r} mode")
    elapsed_s, outputs = _timed(generate, state, prompts, lens)
    requests = [{"prompt_len": len(p), "output_ids": list(map(int, out)), "ttft_s": ttft_s,
                 "e2e_s": elapsed_s if ttft_s is not None else None}
                for p, out in zip(prompts, outputs, strict=True)]
    return {"elapsed_s": elapsed_s, "requests": requests}


def serve(load: Callable[[dict], tuple[Any, dict]], generate: Generate,
          close: Callable[[Any], None] | None = None) -> int:
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(msg: dict) -> None:
        channel.write(json.dumps(msg) + "\n")
        channel.flush()

    try:
        with open(sys.argv[1], encoding="utf-8") as f:
            spec = json.load(f)
        state, info = load(spec)
        send({"event": "ready", **info})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            send({"event": "result", **run_command(cmd, generate, state)})
        if close is not None:
            close(state)
    except Exception as e:
        traceback.print_exc()
        send({"event": "error", "message": f"{type(e).__name__}: {e}"})
        return 1
    return 0
