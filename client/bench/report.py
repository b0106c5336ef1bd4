"""The result files of one `folio bench` run: JSON (everything), Markdown (the side-by-side
table) and a PNG bar plot (when matplotlib is installed: `pip install -e '.[bench]'`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from client.bench.metrics import Aggregate, tpot_ratio

REPO_ROOT = Path(__file__).resolve().parents[2]
# Rows that are plotted, per mode (the table has every metric).
PLOTTED = {
    "throughput": ("output tok/s", "total tok/s"),
    "latency": ("TTFT p50 (ms)", "TPOT p50 (ms)"),
    "serve": ("TTFT p50 (ms)", "TPOT p50 (ms)", "ITL p50 (ms)"),
    "chat": ("prefill tokens computed", "TTFT later turns p50 (ms)"),
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The widest x86 vector ISA the CPU offers, with its bf16 and AMX units, and a lower one
    forced by ATEN_CPU_CAPABILITY (which Folio's fused kernels follow): results differ by it."""
    try:
        flags = set()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        return platform.machine()
    if "avx512f" in flags:
        isa = "AVX512" + (" with AVX512-BF16" if "avx512_bf16" in flags else "")
        isa += " and AMX" if "amx_tile" in flags else ""
    elif "avx2" in flags:
        isa = "AVX2"
    else:
        isa = platform.machine()
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    return f"{isa}, forced to {forced}" if forced else isa


def git_commit() -> str | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True,
                              text=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) if commit else None


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine_facts() -> dict:
    """What the run's numbers depend on, besides the software: taken at the start."""
    return {
        "cpu": cpu_model(),
        "isa": cpu_isa(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "folio_env": {d: _version(d) for d in ("torch", "transformers", "grpcio", "folio")},
        "git_commit": git_commit(),
        "command": " ".join(["folio", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"]
        else " ".join(sys.argv),
    }


def _cell(agg: Aggregate | None) -> str:
    if agg is None:
        return "—"
    fmt = (lambda x: f"{x:.3g}") if abs(agg.median) < 100 else (lambda x: f"{x:.0f}")
    if len(agg.values) == 1 or agg.low == agg.high:
        return fmt(agg.median)
    return f"{fmt(agg.median)} ({fmt(agg.low)}–{fmt(agg.high)})"


def _table(aggregates: dict[str, dict[str, Aggregate]],
           ratio: tuple[str, str] | None = None) -> list[str]:
    """Rows = metrics, columns = peers, and the ratio of two peers' medians when given."""
    peers = list(aggregates)
    rows = list(dict.fromkeys(k for agg in aggregates.values() for k in agg))
    header = ["metric", *peers] + ([f"{ratio[0]} / {ratio[1]}"] if ratio else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row] + [_cell(aggregates[p].get(row)) for p in peers]
        if ratio:
            a, b = aggregates[ratio[0]].get(row), aggregates[ratio[1]].get(row)
            cells.append(f"{a.median / b.median:.2f}" if a and b and b.median else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _machine_lines(result: dict) -> list[str]:
    m = result["machine"]
    return [
        f"- machine: {m['cpu']} ({m.get('isa', 'ISA not recorded')}), {m['logical_cpus']} "
        f"logical CPUs, load average "
        f"{result['load_before'][0]:.2f} before / {result['load_after'][0]:.2f} after",
        f"- commit: {m['git_commit']}; command: `{m['command']}`",
    ]


def markdown(result: dict, aggregates: dict[str, dict[str, Aggregate]]) -> str:
    # The ratio column: Folio over its main peer in the run (vLLM, else llama.cpp).
    other = next((p for p in ("vllm", "llamacpp") if p in aggregates), None)
    with_ratio = "folio" in aggregates and other is not None
    lines = _table(aggregates, ("folio", other) if with_ratio else None)
    w = result["workload"]
    rate = w["request_rate"] if w["request_rate"] is not None else "inf"
    out = [
        f"# folio bench {result['mode']}: {result['name']}",
        "",
        f"- model: `{result['model']['dir']}` ({result['model']['architecture']}, "
        f"{result['dtype']}{', random weights' if result['model']['random_weights'] else ''})",
        f"- workload: {w['dataset']}, {w['num_prompts']} requests, input {w['input_len']} / "
        f"output {w['output_len']} tokens" + (" (means of log-normal lengths)"
                                              if w["dataset"] == "sharegpt-like" else "")
        + f", request rate {rate}, seed {w['seed']}",
        f"- repetitions: {result['reps']} (interleaved; cells are median (min–max))"
        + (", with a competing busy process on one core" if result["competing_load"] else ""),
        *_machine_lines(result),
        "",
        *lines,
        "",
    ]
    if with_ratio:
        out.append(f"folio / {other} above 1 is better for rates (tok/s, req/s), below 1 for "
                   "times.")
    llama = result["peers"].get("llamacpp")
    if llama:
        flags = next((x for x in llama.get("build", "").splitlines()
                      if x.startswith("cmake flags")), "build flags not recorded")
        out.append(f"- llamacpp: llama.cpp {llama['version']} on `{llama['gguf']}`; {flags}")
    for name, why in result["skipped"].items():
        out.append(f"- {name} skipped: {why}")
    return "\n".join(out) + "\n"


def plot(path: Path, mode: str, aggregates: dict[str, dict[str, Aggregate]]) -> str | None:
    """Write the bar plot; return why not when it cannot be drawn."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in PLOTTED[mode] if any(m in a for a in aggregates.values())]
    peers = list(aggregates)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        aggs = [aggregates[p].get(metric) for p in peers]
        medians = [a.median if a else 0.0 for a in aggs]
        errors = [[a.median - a.low if a else 0 for a in aggs],
                  [a.high - a.median if a else 0 for a in aggs]]
        ax.bar(peers, medians, yerr=errors, capsize=4, color=[f"C{i}" for i in range(len(peers))])
        ax.set_title(metric)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write(out_dir: Path, stem: str, result: dict,
          aggregates: dict[str, dict[str, Aggregate]]) -> dict[str, Path]:
    """The JSON, Markdown and PNG of a run whose table is metrics x peers (every mode but
    context)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    result["summary"] = {peer: {k: {"median": a.median, "min": a.low, "max": a.high}
                                for k, a in agg.items()} for peer, agg in aggregates.items()}
    png = out_dir / f"{stem}.png"
    why_not = plot(png, result["mode"], aggregates) if aggregates else "no peer ran"
    result["plot"] = None if why_not else png.name
    if why_not is None:
        paths["png"] = png
    else:
        result["plot_skipped"] = why_not
    paths["md"].write_text((markdown_chat if result["mode"] == "chat" else markdown)(
        result, aggregates))
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    return paths


# ---- `folio bench chat` ---------------------------------------------------------------------

def markdown_chat(result: dict, aggregates: dict[str, dict[str, Aggregate]]) -> str:
    w, pools = result["workload"], result["pools"]
    ratio = (("folio-host-tier", "folio")
             if {"folio-host-tier", "folio"} <= set(aggregates) else None)
    out = [
        f"# folio bench chat: {result['name']}",
        "",
        f"- model: `{result['model']['dir']}` ({result['model']['architecture']}, "
        f"{result['dtype']}{', random weights' if result['model']['random_weights'] else ''})",
        f"- workload: {w['num_conversations']} conversations of {w['num_turns']} turns, "
        f"{w['num_systems']} system prompts of {w['system_len']} tokens, user messages of "
        f"{w['user_len']} and greedy replies of {w['output_len']} tokens (a conversation ends "
        f"at {w['context_len']}), turns round-robin, {w['concurrency']} in flight, seed "
        f"{w['seed']}",
        f"- device KV pool: {pools['device_blocks']} blocks of {pools['block_size']} tokens "
        f"({pools['device_tokens']} tokens; all conversations hold "
        f"{pools['all_conversations_tokens']})"
        + (f"; host tier: {pools['tier_gib']:g} GiB" if pools.get("tier_gib") else ""),
        f"- repetitions: {result['reps']} (new conversations each, every column the same; "
        "cells are median (min–max))"
        + (", with a competing busy process on one core" if result["competing_load"] else ""),
        *_machine_lines(result),
        "",
        *_table(aggregates, ratio),
        "",
        "Prefill counts are the server's (GetServerStats): prompt tokens computed, and "
        "prefix-cache hits (skipped), of which the host tier's were copied back into the "
        "device pool; saved = hits / prompt tokens.",
    ]
    for name, why in result["skipped"].items():
        out.append(f"- {name} skipped: {why}")
    return "\n".join(out) + "\n"


# ---- `folio bench context` ------------------------------------------------------------------

def _window(facts: dict) -> str:
    w = facts.get("sliding_window")
    return f"{w} tokens" if w else "none (full attention)"


def _ratio_cell(ratio: dict | None) -> str:
    if not ratio or ratio.get("ratio") is None:
        return "—"
    return f"{ratio['ratio']:.2f} ({ratio['longest']} vs {ratio['shortest']})"


def markdown_context(result: dict, cells: dict[str, dict[str, dict[str, Aggregate]]]) -> str:
    """Rows = prompt lengths, columns = models (and peers): TPOT, then TTFT."""
    cols = list(result["columns"])
    lens = result["workload"]["input_lens"]
    ratios = result["tpot_ratio"]
    head = ["prompt tokens", *cols]
    sep = "|" + "---|" * len(head)
    window = ["window", *(_window(result["models"][result["columns"][c]["model"]]) for c in cols)]

    def why_empty(col: str, n: int) -> str:
        if col in result["skipped"]:
            return "skipped"
        if str(n) in result["failed"].get(col, {}):
            return "failed"
        return "short" if str(n) in result["short_outputs"].get(col, {}) else "—"

    def table(metric: str) -> list[str]:
        lines = ["| " + " | ".join(head) + " |", sep, "| " + " | ".join(window) + " |"]
        for n in lens:
            row = [str(n)]
            for col in cols:
                agg = cells.get(col, {}).get(str(n), {}).get(metric)
                short = str(n) in result["short_outputs"].get(col, {})
                row.append(_cell(agg) + (" (short)" if short else "") if agg
                           else why_empty(col, n))
            lines.append("| " + " | ".join(row) + " |")
        if metric == "TPOT (ms)":
            lines.append("| " + " | ".join(["longest / shortest",
                                            *(_ratio_cell(ratios.get(c)) for c in cols)]) + " |")
        return lines

    w = result["workload"]
    out = [
        f"# folio bench context: {result['name']}",
        "",
        f"- workload: random prompts of each length, {w['batch_size']} request(s) at once, "
        f"greedy, {w['output_len']} output tokens each (EOS ignored), seed {w['seed']}",
        "- TPOT = (e2e - TTFT) / (output tokens - 1) per request; cells are the median over "
        "requests and repetitions (min–max), in ms",
        f"- repetitions: {result['reps']} (interleaved over lengths and models)"
        + (", with a competing busy process on one core" if result["competing_load"] else ""),
        *_machine_lines(result),
        "- models:",
    ]
    for label, f in result["models"].items():
        out.append(f"  - `{label}`: `{f['dir']}` ({f['architecture']}, {result['dtype']}"
                   f"{', random weights' if f['random_weights'] else ''}), sliding window "
                   f"{_window(f)}, max_model_len {f['max_model_len']}"
                   + (f" (Folio serves {f['folio_max_model_len']})"
                      if f.get("folio_max_model_len") not in (None, f["max_model_len"]) else ""))
    out += ["", "## TPOT (ms) by context", "", *table("TPOT (ms)"), "",
            "## TTFT (ms) by context", "", *table("TTFT (ms)"), ""]
    for col in cols:
        facts = result["models"][result["columns"][col]["model"]]
        r = ratios.get(col)
        if r and r.get("ratio") is not None:
            out.append(f"- {col}, sliding window {_window(facts)}: TPOT at {r['longest']} "
                       f"prompt tokens is {r['ratio']:.2f}x TPOT at {r['shortest']}")
        else:
            out.append(f"- {col}, sliding window {_window(facts)}: no TPOT ratio (fewer than "
                       "two context lengths ran)")
    peers = {c["peer"] for c in result["columns"].values()}
    if peers == {"folio"}:
        out.append("- peers: Folio only (vLLM and HF can be added with --peers)")
    for col, why in result["skipped"].items():
        out.append(f"- {col} skipped: {why}")
    for col, by_len in result["failed"].items():
        for n, why in by_len.items():
            out.append(f"- {col} at {n} prompt tokens: {why.splitlines()[0][:300] if why else ''}")
    for col, by_len in result["short_outputs"].items():
        for n, got in by_len.items():
            out.append(f"- {col} at {n} prompt tokens: short, {got:.0f} output tokens of "
                       f"{w['requested_output_tokens_per_run']} in a run (the context ran out?)")
    return "\n".join(out) + "\n"


def plot_context(path: Path, result: dict,
                 cells: dict[str, dict[str, dict[str, Aggregate]]]) -> str | None:
    """TPOT and TTFT against the prompt length, one line per column."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), squeeze=False)
    for ax, metric in zip(axes[0], ("TPOT (ms)", "TTFT (ms)"), strict=True):
        for col, by_len in cells.items():
            points = sorted((int(n), c[metric]) for n, c in by_len.items() if metric in c)
            if not points:
                continue
            xs = [n for n, _ in points]
            ax.errorbar(xs, [a.median for _, a in points],
                        yerr=[[a.median - a.low for _, a in points],
                              [a.high - a.median for _, a in points]],
                        marker="o", capsize=3, label=col)
        ax.set_xlabel("prompt tokens")
        ax.set_title(metric)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_context(out_dir: Path, stem: str, result: dict,
                  cells: dict[str, dict[str, dict[str, Aggregate]]]) -> dict[str, Path]:
    """The context mode's JSON, Markdown and PNG; `cells` is column -> prompt length (a string,
    as in JSON) -> metric -> Aggregate."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    result["summary"] = {col: {n: {k: {"median": a.median, "min": a.low, "max": a.high,
                                       "count": len(a.values)} for k, a in c.items()}
                               for n, c in by_len.items()} for col, by_len in cells.items()}
    result["tpot_ratio"] = {col: tpot_ratio(by_len) for col, by_len in cells.items()}
    png = out_dir / f"{stem}.png"
    why_not = plot_context(png, result, cells) if any(cells.values()) else "no run succeeded"
    result["plot"] = None if why_not else png.name
    if why_not is None:
        paths["png"] = png
    else:
        result["plot_skipped"] = why_not
    paths["md"].write_text(markdown_context(result, cells))
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    return paths
