"""`python -m scheduler_svc` and `folio serve`: start the gRPC server and the engine loop.

With spawn_executor=True (`folio serve`) the scheduler also runs the executor as a child
process on the address it bound, with a fresh channel secret, restarts it when it dies
(`supervisor.py`), and ends it on shutdown. SIGTERM and SIGINT stop the server within ~2 s.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

import structlog
import zmq

from checkpoints import named_models
from protos.channel import SchedulerEnd
from protos.channel_keys import (
    SECRET_ENV,
    ChannelKeys,
    check_insecure_address,
    generate_secret,
    read_secret,
)
from scheduler_svc.api.server import SchedulerServer
from scheduler_svc.config import DEFAULT_EXECUTOR_ADDRESS, SchedulerConfig, config_from_argv
from scheduler_svc.engine.supervisor import ExecutorSupervisor
from scheduler_svc.text.tokenizer import ModelDirError, Tokenizer, resolve_model_dir

log = structlog.get_logger("folio.scheduler")

def _add_service(_logger, _method, event_dict):
    event_dict.setdefault("service", "scheduler")
    return event_dict


def configure_logging(log_format: str, level: str) -> None:
    processors = [structlog.contextvars.merge_contextvars, _add_service,
                  structlog.processors.add_log_level,
                  structlog.processors.TimeStamper(fmt="iso", utc=True)]
    if log_format == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[
            level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True)


def named_model_path(model: str | None) -> str:
    """The local path of the default model (None) or a `folio:` name (building folio:tiny-random
    on first use)."""
    try:
        return str(named_models.named_model_path(model))
    except ValueError as e:
        what = f"model {model!r}" if model else "the default model"
        raise ModelDirError(f"could not find {what}: {e}") from None


GC_GEN0_THRESHOLD = 10_000  # net container allocations per young collection (default 700)


def tune_garbage_collector() -> None:
    """Call once, after start-up has loaded everything long-lived (modules, the tokenizer).

    1. Freeze what is alive now: it lives as long as the process, yet every full collection
       walked it (~40k objects, 6-17 ms on the benchmark machine, hitting ~1 step in 50 at 256
       running requests). Frozen objects are never examined again.
    2. Raise the young generation's threshold. It counts allocations minus deallocations of
       containers, so a step's plan, outputs and their lists, alive together for a moment,
       crossed the default 700 about 3 times per step at 256 running requests, and every
       ~10th of those collections went on to an older generation (full collections: 6 per
       300 steps). At 10k a step's peak never crosses it; a heap that really grows (new
       requests) still triggers collections, and cyclic garbage waits a little longer."""
    gc.collect()  # garbage from start-up is freed, not frozen
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def main(argv: list[str] | None = None, *, spawn_executor: bool = False) -> int:
    config = config_from_argv(argv, prog="folio serve" if spawn_executor else None)
    configure_logging(config.log_format, config.log_level)
    try:
        return asyncio.run(_serve(config, spawn_executor))
    except KeyboardInterrupt:
        return 130


async def _until_stopped(stop: asyncio.Event, work):
    """Run `work` unless SIGTERM/SIGINT comes first; then None (and `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


def _channel_secret(config: SchedulerConfig, spawn_executor: bool, address: str) -> str | None:
    secret = read_secret(config.channel_secret_file)
    if secret is None and spawn_executor:
        return generate_secret()  # our own child: nobody else gets in
    if secret is None:
        check_insecure_address(address, config.insecure_channel)
        log.warning("the executor channel is not authenticated: any local process can act as "
                    "the executor", address=address,
                    hint=f"set ${SECRET_ENV} or --channel-secret-file on both services")
    return secret


async def _serve(config: SchedulerConfig, spawn_executor: bool) -> int:
    # Signals first: the tokenizer can take seconds to load, and as a container's PID 1 the
    # default SIGTERM action does not apply.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        return await _serve_until(config, spawn_executor, stop)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _serve_until(config: SchedulerConfig, spawn_executor: bool, stop: asyncio.Event
                       ) -> int:
    address = config.executor_address or (
        "tcp://127.0.0.1:*" if spawn_executor else DEFAULT_EXECUTOR_ADDRESS)
    try:
        secret = _channel_secret(config, spawn_executor, address)
        keys = ChannelKeys.from_secret(secret) if secret is not None else None
    except ValueError as e:
        log.error("cannot set up the executor channel", error=str(e))
        return 2
    try:
        loaded = await _until_stopped(stop, _load_tokenizer(config))
    except (ModelDirError, OSError, ValueError) as e:
        log.error("cannot load the model's tokenizer", error=str(e))
        return 1
    if loaded is None:
        log.info("stopped before start-up completed")
        return 0
    model, model_dir, tokenizer = loaded
    config = replace(config, model=model)  # what the served model name is derived from
    tune_garbage_collector()
    try:
        channel = SchedulerEnd(address, keys)
    except zmq.ZMQError as e:
        log.error("cannot bind the executor address", address=address, error=str(e))
        return 1
    supervisor = None
    owned_tier = None  # a tier file this process made, and removes at exit
    if spawn_executor and config.kv_offloading_size and config.kv_offloading_path is None:
        owned_tier = default_tier_path()
        config = replace(config, kv_offloading_path=str(owned_tier))
    if spawn_executor:
        supervisor = ExecutorSupervisor(str(model_dir), channel.address, config.executor_flags(),
                                        secret, config.executor_max_restarts,
                                        config.log_format, config.log_level)
    try:
        server = SchedulerServer(
            config, tokenizer, channel,
            on_executor_change=supervisor.on_executor_change if supervisor else None,
            shutdown_executor_on_stop=spawn_executor)
    except RuntimeError as e:
        channel.close()
        log.error("cannot start the gRPC server: is another server on that port, or does "
                  "grpc reject the TLS certificate or key?", address=config.grpc_address,
                  error=str(e))
        return 1
    except OSError as e:
        channel.close()
        log.error("cannot bind the metrics port: is another server on it?", host=config.host,
                  metrics_port=config.metrics_port, error=str(e))
        return 1
    await server.start()
    log.info("scheduler listening", grpc_address=f"{config.host}:{server.port}",
             executor_address=channel.address, model_dir=str(model_dir),
             channel_authenticated=keys is not None)
    try:
        return await _wait_for_shutdown(server, supervisor, stop)
    finally:
        await server.stop()
        if supervisor is not None:
            await supervisor.stop()
        channel.close()
        if owned_tier is not None:
            owned_tier.unlink(missing_ok=True)
        log.info("scheduler stopped")


def default_tier_path() -> Path:
    """Where `folio serve` keeps the host tier's file: shared memory (/dev/shm) where the
    system has it, else the temporary directory; named for this process, so two servers on a
    host never share one."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"folio-kv-tier-{os.getpid()}"


async def _load_tokenizer(config: SchedulerConfig) -> tuple[str, Path, Tokenizer]:
    """(the model as a path or hub id, its checkpoint directory, its tokenizer)."""
    model = config.model
    if named_models.is_named(model):
        model = await asyncio.to_thread(named_model_path, model)
    cancel = threading.Event()
    try:
        model_dir = await asyncio.to_thread(resolve_model_dir, model, cancel, config.log_format)
    except asyncio.CancelledError:
        # Stopped during a GGUF conversion: its subprocess ends, so the worker thread (which
        # asyncio.run waits for on the way out) returns promptly.
        cancel.set()
        raise
    return model, model_dir, await asyncio.to_thread(Tokenizer, model_dir)


async def _wait_for_shutdown(server: SchedulerServer, supervisor: ExecutorSupervisor | None,
                             stop: asyncio.Event) -> int:
    waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.wait_engine())}
    supervised = asyncio.ensure_future(supervisor.run()) if supervisor is not None else None
    if supervised is not None:
        waits.add(supervised)
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            if task is not supervised:
                task.cancel()
    if supervised is not None and supervised in done:
        return supervised.result()  # it gave up on the executor: the server cannot serve
    if supervised is not None:
        supervised.cancel()  # no restarts from here; server.stop() then supervisor.stop()
    log.info("shutting down")
    return 0
