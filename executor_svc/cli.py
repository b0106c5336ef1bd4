"""`python -m executor_svc`: parse flags into an ExecutorConfig, set up logging, run."""

from __future__ import annotations

import argparse
import logging
import sys

import structlog

from executor_svc.config import (
    DEVICES,
    DTYPES,
    LOG_FORMATS,
    LOG_LEVELS,
    ExecutorConfig,
    parse_memory,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m executor_svc",
                                description="Folio executor: runs the model for a scheduler.")
    p.add_argument("--model", required=True,
                   help="checkpoint directory, or a model hub id to download")
    p.add_argument("--scheduler-address", default="tcp://127.0.0.1:5557",
                   help="ZeroMQ endpoint the scheduler binds (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks to allocate; overrides --kv-cache-memory")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget, e.g. 512MiB or 2GiB (default: 90%% of free GPU "
                        "memory after the weights on CUDA, 1GiB on the CPU)")
    p.add_argument("--swap-space", type=float, default=0.0,
                   help="GiB of host memory for swapped-out KV blocks, e.g. 4 (default 0: "
                        "no swap pool; the scheduler preempts by recompute only)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto = float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="cap on tokens per request (prompt + output)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                   help="default: console in a terminal, json otherwise")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    p.add_argument("--hub-cache-dir", default=None, help="where hub downloads go")
    p.add_argument("--channel-secret-file", default=None,
                   help="file holding the scheduler channel's shared secret (default: "
                        "$FOLIO_CHANNEL_SECRET; none: an unauthenticated channel)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process is gone (folio serve passes its own pid)")
    return p


def config_from_args(args: argparse.Namespace) -> ExecutorConfig:
    log_format = args.log_format or ("console" if sys.stderr.isatty() else "json")
    return ExecutorConfig(
        model=args.model,
        scheduler_address=args.scheduler_address,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=parse_memory(args.kv_cache_memory) if args.kv_cache_memory else None,
        swap_space=args.swap_space,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        log_format=log_format,
        log_level=args.log_level,
        hub_cache_dir=args.hub_cache_dir,
        channel_secret_file=args.channel_secret_file,
        parent_pid=args.parent_pid,
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
    from executor_svc.worker import run  # torch loads only after the flags are known good

    return run(cfg)
