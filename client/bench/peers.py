"""How each peer is started for a run: `folio serve` for Folio, the vLLM and HF runners in
their own interpreters, llama.cpp's server on the GGUF file; and which checkpoint they all
load. Shared by every `folio bench` mode (cli.py, context.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from client.bench import models, report
from client.bench.folio_peer import ConstrainedFolioPeer, FolioPeer
from client.bench.llamacpp_peer import LlamaCppPeer, gguf_file
from client.bench.runner_peer import PeerUnavailable, RunnerPeer

VLLM_VENV = report.REPO_ROOT / ".venv-vllm"


def usable_cpus() -> str:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return ",".join(map(str, cpus))


def num_usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def num_requests(args) -> int:
    """Requests in flight at once in a throughput, latency or serve run."""
    return args.batch_size if args.mode == "latency" else (args.num_prompts or 16)


def make_peer(name: str, args, folio_model: str, model_dir: Path, max_model_len: int,
              kv_tokens: int, log_dir: Path):
    threads_env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    if name in ("folio", "folio-constrained"):
        serve_args = ["--dtype", args.dtype, "--max-model-len", str(max_model_len),
                      "--max-num-seqs", str(args.max_num_seqs),
                      "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                      "--kv-cache-memory", f"{args.kv_cache_gib}GiB", *args.serve_arg]
        cls = FolioPeer if name == "folio" else ConstrainedFolioPeer
        return cls(folio_model, serve_args, threads_env, log_dir)
    if name == "llamacpp":
        # The GGUF file itself (Folio serves the same file: its converted checkpoint keeps the
        # quantized blocks); one slot per request in flight, each with the common context cap
        # (llama.cpp allocates all slots' f16 KV at start: N x max_model_len tokens).
        if args.random_model:
            raise PeerUnavailable(f"llama.cpp runs GGUF files only; --random-model "
                                  f"{args.random_model} is a safetensors checkpoint")
        return LlamaCppPeer(args.llama_server, gguf_file(args.model),
                            slots=min(num_requests(args), args.max_num_seqs),
                            slot_context=max_model_len,
                            threads=args.threads or num_usable_cpus(),
                            max_batch_tokens=args.max_num_batched_tokens, log_dir=log_dir,
                            extra_args=args.llama_arg)
    if name == "vllm":
        spec = {"model_dir": str(model_dir), "dtype": args.dtype, "seed": args.seed,
                "max_model_len": max_model_len, "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens}
        if args.vllm_speculative_config:
            spec["speculative_config"] = json.loads(args.vllm_speculative_config)
        env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind or usable_cpus(),
               # The bench's Folio-side PYTHONPATH must not leak into the vLLM venv.
               "PYTHONPATH": ""}
        return RunnerPeer(name, args.vllm_python, "vllm_runner.py", spec, env, log_dir)
    spec = {"kind": name, "model_dir": str(model_dir), "dtype": args.dtype,
            "batch_size": args.hf_batch_size, "threads": args.threads, "kv_tokens": kv_tokens,
            "max_model_len": max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens}
    return RunnerPeer(name, sys.executable, "hf_runner.py", spec, threads_env, log_dir)


def resolve_model(args) -> tuple[str, Path]:
    """(what `folio serve --model` gets, the HF checkpoint dir the other peers load)."""
    if args.random_model:
        model_dir = models.random_model_dir(args.random_model, args.model_seed)
        return str(model_dir), model_dir
    model_dir = models.resolve_model_dir(args.model)
    return (args.model if args.model is not None else str(model_dir)), \
        models.peer_model_dir(model_dir)
