"""Scheduler overhead benchmark: what one step costs the scheduler process and the channel, on CPU.

    python -m bench.scheduler --out DIR [--running 256] [--steps N] [--quick] [--note TEXT]
                              [--stem NAME]

The real Scheduler (real BlockManager, prefix caching on, default budget 2048 tokens) is built by
`scheduler_svc.engine.handshake.new_scheduler` from the Hello of a *null-model executor*, exactly as the
engine builds it. The null-model executor (`bench/null_executor.py`) is a peer process that
speaks the step-plan protocol over ZeroMQ but runs no model: it answers each StepPlan with a
StepResult holding one token for each request that samples. It imports protos only, never torch
(it exits 3 if torch is loaded).

Per measured step:
  (a) schedule    `Scheduler.schedule()`
  (b) update      `Scheduler.update()` with the null executor's result (one token each, no stop)
  (c) codec       msgpack encode + decode of the plan and of the result (`protos.channel`),
                  timed in-process on the same two messages, after the step
  (d) round_trip  `SchedulerEnd.send(plan)` until the result is received and decoded: the real
                  ZeroMQ round trip between two processes (it contains (c)'s work, both sides)
  gc              time the scheduler process spent in Python's garbage collector during
                  (a) + (d) + (b): already inside them, shown because one collection can
                  make a slow step
  total           wall time of (a) + (d) + (b), the scheduler+IPC time of one step

Workloads, each for running = 1, 16, 64, 256 (and --running):
  decode  N requests with 512-token prompts, prefilled before timing starts, all decoding;
  mixed   the same plus one 32k-token prompt chunk-prefilled with the budget the decodes leave;
          when it completes (it asks for one token) the next one arrives.
`--quick` (plumbing only): running 1, 16 and --running, 64-token prompts, 10 measured steps.
Writes DIR/scheduler.json and DIR/scheduler.md (NAME.json and NAME.md with --stem NAME).
The channel runs over loopback TCP, as in production (`--address ipc://PATH` for a socket file).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import zmq

from bench.null_executor import BLOCK_SIZE, VOCAB_SIZE
from protos.channel import SchedulerEnd, decode, encode
from protos.plan import PROTOCOL_VERSION, Hello, SamplingSpec, Shutdown, StepResult, Welcome

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_US = 1000.0  # BENCHMARKS.md: scheduler+IPC per step, 256 running, CPU <= 1 ms
TIMED_PARTS = ("schedule", "update", "codec", "round_trip", "gc", "total")
MAX_NUM_BATCHED_TOKENS = 2048  # SchedulerConfig's default, stated here for the KV sizing
STEP_TIMEOUT_S = 30.0
FULL = {"running": (1, 16, 64, 256), "steps": 300, "warmup_steps": 20, "prompt_len": 512,
        "long_prompt_len": 32768}  # fmt: skip
QUICK = {"running": (1, 16), "steps": 10, "warmup_steps": 2, "prompt_len": 64,
         "long_prompt_len": 1024}  # fmt: skip


def start_null_executor(address: str, num_kv_blocks: int) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "bench.null_executor", address,
                             str(num_kv_blocks)], cwd=REPO_ROOT, env=env)  # fmt: skip


class GcClock:
    """Nanoseconds spent in the garbage collector, read before and after a step (gc.callbacks)."""

    def __init__(self) -> None:
        self.total_ns = 0
        self._start_ns = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start_ns = time.perf_counter_ns()
        else:
            self.total_ns += time.perf_counter_ns() - self._start_ns


GC_CLOCK = GcClock()


# ---- the scheduler side ---------------------------------------------------------------------------

async def timed_step(sched, end: SchedulerEnd, identity: bytes) -> dict[str, int]:
    """One engine-style step (schedule, send, receive, update), timed part by part in ns."""
    gc0 = GC_CLOCK.total_ns
    t0 = time.perf_counter_ns()
    plan = sched.schedule()
    t1 = time.perf_counter_ns()
    await end.send(identity, plan)
    async with asyncio.timeout(STEP_TIMEOUT_S):
        _, result = await end.recv()
    t2 = time.perf_counter_ns()
    if not (isinstance(result, StepResult) and result.step_id == plan.step_id):
        raise RuntimeError(f"null-model executor answered step {plan.step_id} with {result!r}")
    sched.update(result)
    t3 = time.perf_counter_ns()
    gc_ns = GC_CLOCK.total_ns - gc0
    # The codec is timed again on its own with the collector paused: collections are triggered
    # by allocation counts, and this extra work must not draw into its window the collections
    # that the step itself (which already did this work inside the round trip) would pay for.
    gc.disable()
    try:
        plan_frame, result_frame = encode(plan), encode(result)
        c0 = time.perf_counter_ns()
        decode(encode(plan))
        decode(encode(result))
        c1 = time.perf_counter_ns()
    finally:
        gc.enable()
    return {"schedule": t1 - t0, "round_trip": t2 - t1, "update": t3 - t2, "total": t3 - t0,
            "codec": c1 - c0, "gc": gc_ns, "num_scheduled_tokens": plan.num_scheduled_tokens,
            "num_sampled": len(result.sampled), "plan_bytes": len(plan_frame),
            "result_bytes": len(result_frame)}  # fmt: skip


def kv_blocks_needed(num_running: int, sizes: dict, long_prompt_len: int) -> int:
    """A pool no step can exhaust: preemption would measure a different workload."""
    prefill_steps = math.ceil(num_running * sizes["prompt_len"]
                              / max(1, MAX_NUM_BATCHED_TOKENS - num_running)) + 2  # fmt: skip
    max_len = sizes["prompt_len"] + prefill_steps + sizes["warmup_steps"] + sizes["steps"] + 2
    return (num_running * math.ceil(max_len / BLOCK_SIZE)
            + 2 * math.ceil(long_prompt_len / BLOCK_SIZE) + 64)  # fmt: skip


async def run_case(workload: str, num_running: int, sizes: dict, address: str) -> dict:
    # Imported here, not at the top: the null-model executor runs from this module and must
    # load protos only.
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.engine.handshake import ExecutorInfo, new_scheduler
    from scheduler_svc.sched.request import Request

    long_prompt_len = sizes["long_prompt_len"] if workload == "mixed" else 0
    rng = random.Random(f"{workload}/{num_running}")
    arrivals = iter(range(1 << 30))

    def request(req_id: str, prompt_len: int, max_tokens: int) -> Request:
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)]  # no shared prefixes
        return Request(req_id, prompt, SamplingSpec(temperature=0.0), max_tokens,
                       next(arrivals), ignore_eos=True)  # fmt: skip

    end = SchedulerEnd(address)
    peer = None
    try:
        peer = start_null_executor(end.address, kv_blocks_needed(num_running, sizes,
                                                                 long_prompt_len))  # fmt: skip
        async with asyncio.timeout(STEP_TIMEOUT_S):
            identity, hello = await end.recv()
        assert isinstance(hello, Hello) and hello.protocol_version == PROTOCOL_VERSION, hello
        await end.send(identity, Welcome(protocol_version=PROTOCOL_VERSION))
        config = SchedulerConfig(max_num_seqs=max(256, num_running + 1))
        assert config.enable_prefix_caching, "the benchmark measures the default configuration"
        assert config.max_num_batched_tokens == MAX_NUM_BATCHED_TOKENS
        sched = new_scheduler(ExecutorInfo.from_hello(identity, hello, config.max_model_len),
                              hello, config)  # fmt: skip
        max_tokens = sched.max_model_len - sizes["prompt_len"]
        for i in range(num_running):
            sched.add_request(request(f"decode-{i}", sizes["prompt_len"], max_tokens))
        decodes = list(sched.queues.requests.values())
        while sched.queues.waiting or any(r.num_output_tokens == 0 for r in decodes):
            await timed_step(sched, end, identity)  # prefill, not recorded
        samples: list[dict[str, int]] = []
        num_long = 0
        for step in range(sizes["warmup_steps"] + sizes["steps"]):
            if long_prompt_len and len(sched.queues.requests) == num_running:
                sched.add_request(request(f"long-{num_long}", long_prompt_len, 1))
                num_long += 1
            sample = await timed_step(sched, end, identity)
            if step >= sizes["warmup_steps"]:
                samples.append(sample)
        assert sched.counters.num_preemptions == 0, "the KV pool was sized to avoid preemption"
        await end.send(identity, Shutdown())
        peer_rc = await asyncio.to_thread(peer.wait, STEP_TIMEOUT_S)
        if peer_rc != 0:
            raise RuntimeError(f"null-model executor exited {peer_rc} (3 = it imported torch)")
    finally:
        if peer is not None and peer.poll() is None:
            peer.kill()  # by pid: only the process this case started
            peer.wait()
        end.close()
    return summarize(workload, num_running, samples, num_long, hello, peer_rc)


def summarize(workload: str, num_running: int, samples: list[dict[str, int]], num_long: int,
              hello: Hello, peer_rc: int) -> dict:
    row: dict = {"workload": workload, "running": num_running, "steps": len(samples),
                 "num_kv_blocks": hello.num_kv_blocks, "long_prompts_started": num_long,
                 "executor": f"{hello.architecture} (null model, {hello.executor_id})",
                 "null_executor_exit_code": peer_rc,
                 "null_executor_imported_torch": peer_rc == 3}  # fmt: skip
    for part in TIMED_PARTS:
        us = sorted(s[part] / 1e3 for s in samples)
        row[part] = {"p50_us": nearest_rank(us, 0.50), "p99_us": nearest_rank(us, 0.99),
                     "mean_us": sum(us) / len(us)}  # fmt: skip
    for count in ("num_scheduled_tokens", "num_sampled", "plan_bytes", "result_bytes"):
        row[f"mean_{count}"] = sum(s[count] for s in samples) / len(samples)
    return row


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """The q-quantile by the nearest-rank rule: an observed value, never an interpolation."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


# ---- the run and its report -----------------------------------------------------------------------

def environment(argv: list[str]) -> dict:
    def git(*args: str) -> str:
        # GIT_OPTIONAL_LOCKS=0: status must not refresh (write) the index of a shared checkout.
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              env=dict(os.environ, GIT_OPTIONAL_LOCKS="0")).stdout.strip()  # fmt: skip

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
              if line.startswith("model name")]  # fmt: skip
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "HEAD") or "unknown",
        "worktree_dirty": bool(git("status", "--porcelain")),
        "cpu_model": models[0] if models else platform.processor() or "unknown",
        "num_cpus": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: metadata.version(name) for name in ("pyzmq", "msgpack", "structlog")},
        "libzmq": zmq.zmq_version(),
        "command": shlex.join(["python", "-m", "bench.scheduler", *argv]),
    }


async def run_all(args, sizes: dict) -> list[dict]:
    # As `python -m scheduler_svc` does once start-up is done (the collector's tuning).
    from scheduler_svc.cli import tune_garbage_collector

    tune_garbage_collector()
    rows = []
    gc.callbacks.append(GC_CLOCK)
    try:
        for workload in ("decode", "mixed"):
            for num_running in sorted({*sizes["running"], args.running}):
                rows.append(await run_case(workload, num_running, sizes, args.address))
                total = rows[-1]["total"]
                print(f"{workload:6} running={num_running:4}  total p50 {total['p50_us']:8.1f} "
                      f"us  p99 {total['p99_us']:8.1f} us", flush=True)  # fmt: skip
    finally:
        gc.callbacks.remove(GC_CLOCK)
    return rows


def verdict(rows: list[dict]) -> dict:
    """The target row: 256 running decodes (the BENCHMARKS.md case)."""
    row = next((r for r in rows if r["workload"] == "decode" and r["running"] == 256), None)
    if row is None:
        return {"target_us": TARGET_US, "measured": False}
    total = row["total"]
    return {"target_us": TARGET_US, "measured": True, "p50_us": total["p50_us"],
            "p99_us": total["p99_us"], "mean_us": total["mean_us"],
            "met_at_p50": total["p50_us"] <= TARGET_US,
            "met_at_p99": total["p99_us"] <= TARGET_US}  # fmt: skip


def markdown_report(result: dict) -> str:
    env, target = result["environment"], result["target"]
    lines = [
        "# Scheduler + IPC overhead per step (CPU, null-model executor)", "",
        f"- date: {env['date_utc']}; commit `{env['commit']}`"
        + (" (worktree had uncommitted changes)" if env["worktree_dirty"] else ""),
        f"- machine: {env['cpu_model']}, {env['num_cpus']} logical CPUs; 1-minute load average "
        f"{env['load_average_at_start'][0]:.2f} at start, {env['load_average_at_end'][0]:.2f} "
        f"at end; {env['platform']}",
        f"- Python {env['python']}, pyzmq {env['versions']['pyzmq']} (libzmq {env['libzmq']}), "
        f"msgpack {env['versions']['msgpack']}",
        f"- command: `{env['command']}`",
        f"- workload: {result['workload_description']}",
    ]
    if result.get("note"):
        lines.append(f"- note: {result['note']}")
    if target["measured"]:
        met = "MET" if target["met_at_p50"] else "NOT MET"
        lines.append(f"- target <= {TARGET_US:.0f} us per step at 256 running (decode): {met} "
                     f"at p50 ({target['p50_us']:.0f} us); p99 {target['p99_us']:.0f} us "
                     f"({'within' if target['met_at_p99'] else 'over'} the target)")
    lines += ["", "Cells: p50 / p99 / mean in microseconds. total = schedule + round trip + "
              "update (wall time); codec is part of the round trip and gc (the scheduler process's "
              "garbage collection) part of the three, each shown on its own.", ""]
    for workload in ("decode", "mixed"):
        lines += [f"## {workload}", "",
                  "| running | schedule | update | codec | ZeroMQ round trip | gc | total | "
                  "tokens/step | plan bytes |", "|---|---|---|---|---|---|---|---|---|"]
        for row in (r for r in result["rows"] if r["workload"] == workload):
            cells = [" / ".join(f"{row[p][k]:.0f}" for k in ("p50_us", "p99_us", "mean_us"))
                     for p in TIMED_PARTS]  # fmt: skip
            cells[-1] = f"**{cells[-1]}**"
            lines.append(f"| {row['running']} | " + " | ".join(cells)
                         + f" | {row['mean_num_scheduled_tokens']:.0f}"
                         f" | {row['mean_plan_bytes']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.scheduler",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--out", type=Path, help="directory for scheduler.json/.md")
    parser.add_argument("--running", type=int, default=256, help="one more running count")
    parser.add_argument("--steps", type=int, help="measured steps per case (default 300)")
    parser.add_argument("--quick", action="store_true", help="few cases, short prompts")
    parser.add_argument("--address", default="tcp://127.0.0.1:0",
                        help="where the scheduler end binds: loopback tcp or ipc://PATH")
    parser.add_argument("--stem", default="scheduler", help="file name of the .json and .md")
    parser.add_argument("--note", default="", help="a remark for the report (e.g. machine load)")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out DIR is required")
    if not (args.address.startswith("tcp://127.0.0.1:") or args.address.startswith("ipc://")):
        parser.error("--address must be loopback (tcp://127.0.0.1:PORT) or ipc://PATH")
    if args.running < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--running and --steps must be at least 1")
    sizes = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        sizes["steps"] = args.steps
    env = environment(argv)
    rows = asyncio.run(run_all(args, sizes))
    env["load_average_at_end"] = list(os.getloadavg())
    assert "torch" not in sys.modules, "the scheduler side must not load torch"
    description = (f"decode: N requests, {sizes['prompt_len']}-token prompts prefilled before "
                   f"timing, decoding one token per step; mixed: the same plus one "
                   f"{sizes['long_prompt_len']}-token prompt chunk-prefilled at a time; "
                   f"{sizes['warmup_steps']} warm-up + {sizes['steps']} measured steps per "
                   f"case; block size {BLOCK_SIZE}, max_num_batched_tokens "
                   f"{MAX_NUM_BATCHED_TOKENS}, prefix caching on, no preemption")  # fmt: skip
    result = {"environment": env, "sizes": sizes, "workload_description": description,
              "note": args.note, "target": verdict(rows), "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / f"{args.stem}.json", args.out / f"{args.stem}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown_report(result) + "\n")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
