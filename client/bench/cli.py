"""`folio bench throughput|latency|serve|context`: one seeded workload, Folio and its peers, one run.

    folio bench throughput --random-model qwen2.5-0.5b --num-prompts 16 --input-len 128 \\
        --output-len 32 --peers folio,vllm,hf,hf-batch --reps 3 --out bench/results
    folio bench context --random-model smollm2-135m-mistral,smollm2-135m-swa256 \\
        --input-lens 256,1024,2048,4096 --batch-size 1 --output-len 32 --reps 2

`context` runs the latency workload at several prompt lengths for one or more models (Folio
only by default) and reports decode time per token against the context (client/bench/context.py).
`chat` runs multi-turn conversations whose prefixes outgrow the device's KV pool, Folio with
and without the prefix cache's host tier (client/bench/chat.py).

Every peer loads the same checkpoint directory in the same dtype (llamacpp: the GGUF file that
Folio's converted checkpoint comes from, with the same quantized blocks) and gets the same prompt
token ids (greedy, EOS ignored, so each request yields exactly its output length). Peers start
once and stay up; repetitions interleave them (folio, vllm, hf, folio, vllm, hf, ...), each
after a warm-up, and the report gives the median and range over repetitions. A peer that
cannot run here (no vLLM venv, a failed start) is reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import re
import sys
from pathlib import Path

from client.bench import chat, context, models, report
from client.bench.llamacpp_peer import DEFAULT_LLAMA_SERVER
from client.bench.load import competing_load, settle
from client.bench.metrics import MODES, aggregate, same_tokens, summarize
from client.bench.peers import VLLM_VENV, make_peer, resolve_model
from client.bench.runner_peer import PeerUnavailable
from client.bench.workload import DATASETS, WorkloadSpec, make_requests, warmup_requests

PEERS = ("folio", "folio-constrained", "vllm", "hf", "hf-batch", "llamacpp")
DEFAULT_PEERS = ("folio", "vllm", "hf", "hf-batch")
OFFLINE_PEERS = ("vllm", "hf", "hf-batch")  # no streaming server: not in serve mode
DEFAULT_MAX_MODEL_LEN = 4096  # caps the context (and so the KV sizing) of long-context configs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="folio bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=MODES)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=os.environ.get("FOLIO_MODEL") or None,
                   help="what `folio serve --model` takes (a checkpoint dir, a .gguf file, "
                   "folio:tiny-random; default: Folio's default model)")
    m.add_argument("--random-model", default=None, metavar="NAME",
                   help="a random-weight checkpoint from this real config instead (seeded, "
                   "cached under $FOLIO_CACHE_DIR/bench-models), one of "
                   f"{', '.join(sorted(models.RANDOM_MODELS))}; context mode takes a "
                   "comma-separated list (one column each)")
    m.add_argument("--model-seed", type=int, default=0, help="seed of --random-model weights")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m.add_argument("--max-model-len", type=int, default=None,
                   help=f"context cap for every peer (default: the config's, at most "
                   f"{DEFAULT_MAX_MODEL_LEN})")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=DATASETS, default="random")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="requests per repetition (default 16; latency: --batch-size)")
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=32)
    w.add_argument("--batch-size", type=int, default=1,
                   help="latency and context modes: requests at once")
    w.add_argument("--input-lens", default=context.DEFAULT_INPUT_LENS,
                   help="context mode: comma-separated prompt lengths (default "
                   f"{context.DEFAULT_INPUT_LENS})")
    w.add_argument("--request-rate", type=float, default=math.inf,
                   help="serve mode: Poisson arrivals per second (default inf: all at once)")
    w.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("chat mode (client/bench/chat.py)")
    c.add_argument("--conversations", type=int, default=24, help="conversations per repetition")
    c.add_argument("--turns", type=int, default=4, help="turns per conversation")
    c.add_argument("--system-len", type=int, default=256, help="tokens of a system prompt")
    c.add_argument("--num-systems", type=int, default=4,
                   help="distinct system prompts, shared round-robin by the conversations")
    c.add_argument("--user-len", type=int, default=64, help="tokens of a user message")
    c.add_argument("--concurrency", type=int, default=4, help="turns in flight at once")
    c.add_argument("--kv-blocks", type=int, default=None,
                   help="device KV pool in 16-token blocks (default: the system prompts plus "
                   "1.5x what the conversations in flight hold at their longest)")
    c.add_argument("--tier-gib", type=float, default=2.0,
                   help="the host tier of folio-host-tier (--kv-offloading-size), GiB")
    r = p.add_argument_group("peers and repetitions")
    r.add_argument("--peers", default=None,
                   help=f"comma-separated, from {','.join(PEERS)} (default "
                        f"{','.join(DEFAULT_PEERS)}; context mode: folio; folio-constrained: "
                        "Folio with every other request under structured output; llamacpp: "
                        "llama.cpp's server on the GGUF file, see --llama-server; chat mode: "
                        f"from {','.join(chat.CHAT_PEERS)}, default "
                        f"{','.join(chat.DEFAULT_CHAT_PEERS)})")
    r.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    r.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed warm-up run of each peer")
    r.add_argument("--competing-load", action="store_true",
                   help="run a busy loop pinned to one core during every timed run")
    r.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for Folio's executor and the HF peers")
    r.add_argument("--max-num-seqs", type=int, default=256, help="Folio and vLLM")
    r.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="Folio, vLLM and hf-batch")
    r.add_argument("--kv-cache-gib", type=int, default=2,
                   help="KV cache size for Folio (--kv-cache-memory) and vLLM "
                   "(VLLM_CPU_KVCACHE_SPACE), GiB (default 2)")
    r.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `folio serve` (repeatable), e.g. --serve-arg=--no-prefix-caching")
    r.add_argument("--vllm-python", default=os.environ.get("FOLIO_BENCH_VLLM_PYTHON")
                   or str(VLLM_VENV / "bin" / "python"),
                   help="the vLLM venv's python (default .venv-vllm/bin/python at the repo "
                   "root; bench/install_vllm_cpu.sh makes it)")
    r.add_argument("--vllm-threads-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND (default: every usable core, like Folio; "
                   "vLLM's own 'auto' keeps one core in reserve)")
    r.add_argument("--vllm-speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative_config for the vllm peer, e.g. "
                   "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (default off)")
    r.add_argument("--llama-server", default=os.environ.get("FOLIO_BENCH_LLAMA_SERVER")
                   or str(DEFAULT_LLAMA_SERVER),
                   help="llama.cpp's server binary for the llamacpp peer (default "
                   ".llama-cpp/bin/llama-server at the repo root; bench/install_llama_cpp.sh "
                   "builds it); the peer runs the GGUF file of --model or of the default model")
    r.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for llama-server (repeatable), e.g. "
                   "--llama-arg=--poll --llama-arg=0")
    r.add_argument("--hf-batch-size", type=int, default=16, help="padded batch of `hf`")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench/results", help="directory for the result files")
    o.add_argument("--name", default=None, help="file name after the date (default: "
                   "MODE-MODEL-DTYPE; context: context-MODEL-vs-MODEL-DTYPE)")
    return p


def parse_peers(text: str) -> list[str]:
    peers = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in peers if x not in PEERS]
    if unknown or not peers:
        raise SystemExit(f"folio bench: --peers takes names from {', '.join(PEERS)}; "
                         f"got {text!r}")
    return list(dict.fromkeys(peers))


def parse_random_models(text: str | None, mode: str) -> list[str]:
    """`--random-model`: one name, or for context mode a comma-separated list."""
    if text is None:
        return []
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [x for x in names if x not in models.RANDOM_MODELS]
    if unknown or not names:
        raise SystemExit(f"folio bench: --random-model is one of "
                         f"{', '.join(sorted(models.RANDOM_MODELS))}; got {text!r}")
    if len(names) > 1 and mode != "context":
        raise SystemExit(f"folio bench: --random-model takes several names in context mode "
                         f"only; {mode} runs one model")
    return names


def default_peers(mode: str) -> tuple[str, ...]:
    return ("folio",) if mode == "context" else DEFAULT_PEERS


def default_name(args, model_dir: Path) -> str:
    model = args.random_model or model_dir.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{args.mode}-{model}-{args.dtype}")


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    random_names = parse_random_models(args.random_model, args.mode)
    if args.reps < 1:
        raise SystemExit("folio bench: --reps must be at least 1")
    if args.mode == "chat":
        return chat.run(args, chat.parse_chat_peers(args.peers))
    peer_names = parse_peers(args.peers or ",".join(default_peers(args.mode)))
    if args.mode == "context":
        return context.run(args, random_names, peer_names)
    facts = report.machine_facts()
    folio_model, model_dir = resolve_model(args)
    config = models.read_config(model_dir)
    max_model_len = args.max_model_len or min(models.max_model_len(config),
                                               DEFAULT_MAX_MODEL_LEN)
    num_prompts = args.batch_size if args.mode == "latency" else (args.num_prompts or 16)
    try:
        spec = WorkloadSpec(dataset=args.dataset, num_prompts=num_prompts,
                            input_len=args.input_len, output_len=args.output_len,
                            request_rate=args.request_rate if args.mode == "serve" else math.inf,
                            seed=args.seed, vocab_size=int(config["vocab_size"]),
                            max_model_len=max_model_len)
    except ValueError as e:
        raise SystemExit(f"folio bench: {e}") from None
    first_reqs = make_requests(spec, 0)
    kv_tokens = sum(r.prompt_len + r.output_len for r in first_reqs)
    stem = f"{datetime.date.today().isoformat()}-{args.name or default_name(args, model_dir)}"
    log_dir = Path(args.out) / f"{stem}-logs"

    skipped: dict[str, str] = {}
    if args.mode == "serve":
        for name in peer_names:
            if name in OFFLINE_PEERS:
                skipped[name] = "an offline peer: serve mode needs a streaming server"
    candidates = [n for n in peer_names if n not in skipped]
    peers, peer_info = [], {}
    total = 2 * len(candidates) + args.reps * len(candidates)
    progress = tqdm(total=total, desc="folio bench", unit="step", file=sys.stderr)
    per_rep: dict[str, list[dict[str, float]]] = {}
    raw: dict[str, list[dict]] = {}
    load_before = os.getloadavg()
    try:
        for name in candidates:
            progress.set_postfix_str(f"starting {name}")
            try:
                peer = make_peer(name, args, folio_model, model_dir, max_model_len, kv_tokens,
                                 log_dir)
            except PeerUnavailable as e:  # llamacpp on a model that is no GGUF file
                skipped[name] = str(e)
                progress.total -= args.reps
                progress.update(2)
                continue
            try:
                peer_info[name] = peer.start()
                if args.warmup:
                    progress.set_postfix_str(f"warming up {name}")
                    peer.run(args.mode, warmup_requests(spec))
                peers.append(peer)
            except PeerUnavailable as e:
                hint = {"vllm": " (run bench/install_vllm_cpu.sh)"}.get(name, "")
                skipped[name] = f"{e}{hint}"
                peer.stop()
            except Exception as e:  # a peer that fails to start must not end the benchmark
                skipped[name] = f"failed to start: {str(e)[:2000]}"
                peer.stop()
            if name in skipped:
                progress.total -= args.reps
            progress.update(2)
        load_before = os.getloadavg()
        for rep in range(args.reps):
            requests = make_requests(spec, rep)
            reference, reference_metrics = None, {}
            for peer in peers:
                progress.set_postfix_str(f"rep {rep + 1}/{args.reps}: {peer.name}")
                settle()
                with competing_load(args.competing_load):
                    run = peer.run(args.mode, requests)
                metrics = summarize(args.mode, run)
                if peer.name == "folio":
                    reference, reference_metrics = run, metrics
                if peer.name == "folio-constrained" and reference is not None:
                    metrics["output tok/s vs folio (%)"] = (
                        100.0 * metrics["output tok/s"] / reference_metrics["output tok/s"])
                elif reference is not None and peer.name != "folio":
                    metrics["same tokens as folio (%)"] = 100.0 * same_tokens(run, reference)
                per_rep.setdefault(peer.name, []).append(metrics)
                raw.setdefault(peer.name, []).append({
                    "rep": rep, "elapsed_s": run.elapsed_s, "metrics": metrics,
                    "requests": [{"prompt_len": t.prompt_len, "num_output": t.num_output,
                                  "ttft_s": t.ttft_s, "e2e_s": t.e2e_s} for t in run.requests]})
                progress.update(1)
    finally:
        progress.set_postfix_str("stopping peers")
        for peer in peers:
            with contextlib.suppress(Exception):
                peer.stop()
        progress.close()
    load_after = os.getloadavg()

    aggregates = {name: aggregate(reps) for name, reps in per_rep.items()}
    requested = sum(r.output_len for r in first_reqs)
    short = {n: a["output tokens"].low for n, a in aggregates.items()
             if a["output tokens"].low != requested}
    result = {
        "mode": args.mode, "name": stem, "dtype": args.dtype, "reps": args.reps,
        "competing_load": args.competing_load, "machine": facts,
        "load_before": list(load_before), "load_after": list(load_after),
        "model": models.model_facts(model_dir, folio_model, config, max_model_len),
        "workload": spec.to_dict() | {"requested_output_tokens": requested},
        "settings": {k: v for k, v in vars(args).items() if k != "mode"}
        | {"request_rate": None if math.isinf(args.request_rate) else args.request_rate},
        "peers": peer_info, "skipped": skipped, "short_outputs": short, "runs": raw,
    }
    paths = report.write(Path(args.out), stem, result, aggregates)
    print((Path(args.out) / f"{stem}.md").read_text())
    for n, got in short.items():
        print(f"folio bench: {n} produced {got:.0f} output tokens, not {requested}",
              file=sys.stderr)
    if result.get("plot_skipped"):
        print(f"folio bench: {result['plot_skipped']}", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0 if aggregates and not short else 1


if __name__ == "__main__":
    sys.exit(main())
