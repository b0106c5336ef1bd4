"""`folio bench context`: decode time per output token as the context grows, per model.

    folio bench context --random-model smollm2-135m-mistral,smollm2-135m-swa256 \\
        --input-lens 256,1024,2048,4096 --batch-size 1 --output-len 32 --reps 2 --out bench/results

The latency workload (a batch of `--batch-size` requests at once, greedy, EOS ignored, exactly
`--output-len` tokens each) at every prompt length of `--input-lens`, for every model (a
comma-separated `--random-model` list, or one `--model`). One server per model starts once and
stays up; repetitions interleave lengths and models (rep 1: length 1 model A, length 1 model B,
length 2 model A, ...), each run after the cores settle. The metric is TPOT, (e2e - TTFT) /
(output tokens - 1) per request, pooled over requests and repetitions (median, min–max), and
TTFT beside it. The point is the shape: a sliding-window model's decode reads only its window,
so its TPOT should stay flat once the context passes the window, while full attention's grows;
the report gives each model's window and its TPOT at the longest over the shortest context.

Folio is the default and the peer this mode is for; `--peers` may add vllm, hf or hf-batch
(one column per model and peer).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import statistics
import sys
from pathlib import Path

from client.bench import models, report
from client.bench.load import competing_load, settle
from client.bench.metrics import Aggregate, RunResult, summarize
from client.bench.peers import make_peer, resolve_model
from client.bench.runner_peer import PeerUnavailable
from client.bench.workload import WorkloadSpec, make_requests, warmup_requests

DEFAULT_INPUT_LENS = "256,1024,2048,4096"
CONTEXT_PEERS = ("folio", "vllm", "hf", "hf-batch")
METRICS = ("TPOT (ms)", "TTFT (ms)")


def parse_input_lens(text: str) -> list[int]:
    """`--input-lens 256,1024`: distinct positive prompt lengths, ascending."""
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lens = []
    if not lens or min(lens) < 1:
        raise SystemExit(f"folio bench: --input-lens takes a comma-separated list of positive "
                         f"prompt lengths, e.g. {DEFAULT_INPUT_LENS}; got {text!r}")
    return sorted(set(lens))


def error_text(e: Exception) -> str:
    """One line for a failed run: a gRPC error's status and details, else the exception."""
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    if callable(code) and callable(details):
        with contextlib.suppress(Exception):
            return f"{code().name}: {details()}"
    return " ".join(str(e).split())[:1000] or type(e).__name__


def column_name(model: str, peer: str, num_peers: int) -> str:
    return model if num_peers == 1 else f"{model} ({peer})"


def pooled(values: list[float]) -> Aggregate | None:
    if not values:
        return None
    return Aggregate(statistics.median(values), min(values), max(values), values)


def cell_aggregates(runs: list[dict]) -> dict[str, Aggregate]:
    """TPOT and TTFT in ms over every request of every repetition of one (column, length)."""
    reqs = [r for run in runs for r in run["requests"]]
    tpot = [1e3 * (r["e2e_s"] - r["ttft_s"]) / (r["num_output"] - 1) for r in reqs
            if r["ttft_s"] is not None and r["e2e_s"] is not None and r["num_output"] >= 2]
    ttft = [1e3 * r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
    return {k: a for k, a in zip(METRICS, (pooled(tpot), pooled(ttft)), strict=True) if a}


def default_name(labels: list[str], dtype: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"context-{'-vs-'.join(labels)}-{dtype}")


def resolve_models(args, random_names: list[str]) -> list[tuple[str, str, Path]]:
    """(label, what `folio serve --model` gets, the HF checkpoint dir) per model."""
    if random_names:
        return [(n, str(d), d) for n in random_names
                for d in [models.random_model_dir(n, args.model_seed)]]
    folio_model, model_dir = resolve_model(args)
    return [(model_dir.name, folio_model, model_dir)]


def run(args, random_names: list[str], peer_names: list[str]) -> int:
    from tqdm import tqdm

    unknown = [p for p in peer_names if p not in CONTEXT_PEERS]
    if unknown:
        raise SystemExit(f"folio bench: context mode runs the peers {', '.join(CONTEXT_PEERS)};"
                         f" got {', '.join(unknown)}")
    lens = parse_input_lens(args.input_lens)
    facts = report.machine_facts()
    model_list = resolve_models(args, random_names)
    labels = [label for label, _, _ in model_list]
    if len(set(labels)) != len(labels):
        raise SystemExit("folio bench: a model is named twice in --random-model")
    stem = f"{datetime.date.today().isoformat()}-{args.name or default_name(labels, args.dtype)}"
    log_dir = Path(args.out) / f"{stem}-logs"
    needed = lens[-1] + args.output_len

    model_facts: dict[str, dict] = {}
    columns: dict[str, dict] = {}  # column -> model, peer, the workload spec of every length
    failed: dict[str, dict[str, str]] = {}  # column -> prompt length -> why it did not run
    for label, folio_model, model_dir in model_list:
        config = models.read_config(model_dir)
        max_len = args.max_model_len or min(models.max_model_len(config), needed)
        model_facts[label] = {
            "dir": str(model_dir), "folio_model": folio_model,
            "architecture": (config.get("architectures") or ["?"])[0],
            "random_weights": (model_dir / models.MARKER).exists(),
            "sliding_window": models.sliding_window(config), "max_model_len": max_len,
            "config": config}
        for peer in peer_names:
            col = column_name(label, peer, len(peer_names))
            specs = {}
            for n in lens:
                try:
                    specs[n] = WorkloadSpec(num_prompts=args.batch_size, input_len=n,
                                            output_len=args.output_len, seed=args.seed,
                                            vocab_size=int(config["vocab_size"]),
                                            max_model_len=max_len)
                except ValueError as e:
                    failed.setdefault(col, {})[str(n)] = f"not run: {e}"
            columns[col] = {"model": label, "peer": peer, "specs": specs,
                            "folio_model": folio_model, "model_dir": model_dir,
                            "max_model_len": max_len}

    peers, peer_info, skipped = {}, {}, {}
    raw: dict[str, dict[str, list[dict]]] = {col: {} for col in columns}
    short: dict[str, dict[str, float]] = {}
    num_runs = sum(len(c["specs"]) for c in columns.values())
    progress = tqdm(total=2 * len(columns) + args.reps * num_runs, desc="folio bench context",
                    unit="step", file=sys.stderr)
    load_before = os.getloadavg()
    try:
        for col, c in columns.items():
            progress.set_postfix_str(f"starting {col}")
            kv_tokens = args.batch_size * (lens[-1] + args.output_len)
            peer = make_peer(c["peer"], args, c["folio_model"], c["model_dir"],
                             c["max_model_len"], kv_tokens, log_dir / re.sub(r"\W+", "-", col))
            try:
                peer_info[col] = peer.start()
                served = (peer_info[col].get("model_info") or {}).get("max_model_len")
                if c["peer"] == "folio" and served:
                    model_facts[c["model"]]["folio_max_model_len"] = served
                if args.warmup and c["specs"]:
                    progress.set_postfix_str(f"warming up {col}")
                    peer.run("latency", warmup_requests(c["specs"][min(c["specs"])]))
                peers[col] = peer
            except PeerUnavailable as e:
                skipped[col] = str(e)
                peer.stop()
            except Exception as e:  # one model that cannot start must not end the benchmark
                skipped[col] = f"failed to start: {str(e)[:2000]}"
                peer.stop()
            if col in skipped:
                progress.total -= args.reps * len(c["specs"])
            progress.update(2)
        load_before = os.getloadavg()
        for rep in range(args.reps):
            for n in lens:
                for col, peer in peers.items():
                    spec = columns[col]["specs"].get(n)
                    if spec is None or str(n) in failed.get(col, {}):
                        if spec is not None:
                            progress.update(1)
                        continue
                    progress.set_postfix_str(f"rep {rep + 1}/{args.reps}: {col} at {n}")
                    requests = make_requests(spec, rep)
                    settle()
                    try:
                        with competing_load(args.competing_load):
                            result: RunResult = peer.run("latency", requests)
                    except Exception as e:  # e.g. a prompt longer than the server's context
                        failed.setdefault(col, {})[str(n)] = f"failed: {error_text(e)}"
                        progress.update(1)
                        continue
                    wanted = sum(r.output_len for r in requests)
                    got = sum(t.num_output for t in result.requests)
                    if got != wanted:
                        short.setdefault(col, {})[str(n)] = float(got)
                    raw[col].setdefault(str(n), []).append({
                        "rep": rep, "elapsed_s": result.elapsed_s,
                        "metrics": summarize("latency", result),
                        "requests": [{"prompt_len": t.prompt_len, "num_output": t.num_output,
                                      "ttft_s": t.ttft_s, "e2e_s": t.e2e_s}
                                     for t in result.requests]})
                    progress.update(1)
    finally:
        progress.set_postfix_str("stopping peers")
        for peer in peers.values():
            with contextlib.suppress(Exception):
                peer.stop()
        progress.close()
    load_after = os.getloadavg()

    # A length that failed in a later repetition keeps its earlier runs out of the table too:
    # a cell is every repetition or none.
    for col, why in failed.items():
        for n in why:
            raw.get(col, {}).pop(n, None)
    cells = {col: {n: cell_aggregates(runs) for n, runs in by_len.items()}
             for col, by_len in raw.items() if col in peers}
    result = {
        "mode": "context", "name": stem, "dtype": args.dtype, "reps": args.reps,
        "competing_load": args.competing_load, "machine": facts,
        "load_before": list(load_before), "load_after": list(load_after),
        "models": model_facts,
        "columns": {col: {"model": c["model"], "peer": c["peer"]} for col, c in columns.items()},
        "workload": {"dataset": "random", "batch_size": args.batch_size, "input_lens": lens,
                     "output_len": args.output_len, "seed": args.seed,
                     "requested_output_tokens_per_run": args.batch_size * args.output_len},
        "settings": {k: v for k, v in vars(args).items() if k != "mode"},
        "peers": peer_info, "skipped": skipped, "failed": failed, "short_outputs": short,
        "runs": raw,
    }
    paths = report.write_context(Path(args.out), stem, result, cells)
    print(paths["md"].read_text())
    for col, by_len in short.items():
        for n, got in by_len.items():
            print(f"folio bench: {col} at {n} produced {got:.0f} output tokens, not "
                  f"{args.batch_size * args.output_len}", file=sys.stderr)
    for col, by_len in failed.items():
        for n, why in by_len.items():
            print(f"folio bench: {col} at {n}: {why.splitlines()[0][:300]}", file=sys.stderr)
    if result.get("plot_skipped"):
        print(f"folio bench: {result['plot_skipped']}", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    ran = any(cells.values())
    unstarted = any(why.startswith("failed to start") for why in skipped.values())
    return 0 if ran and not short and not failed and not unstarted else 1
