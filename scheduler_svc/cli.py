"""`python -m scheduler_svc` and `folio serve`: start the gRPC server and the engine loop.

With spawn_executor=True (`folio serve`) the scheduler also starts the executor as a child
process on the address it bound, and ends it on shutdown (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import subprocess
import sys

import structlog
import zmq

from protos.channel import SchedulerEnd
from scheduler_svc.config import DEFAULT_EXECUTOR_ADDRESS, SchedulerConfig, config_from_argv
from scheduler_svc.server import SchedulerServer
from scheduler_svc.tokenizer import ModelDirError, Tokenizer, resolve_model_dir

log = structlog.get_logger("folio.scheduler")

CHILD_EXIT_GRACE_S = 3.0  # after Shutdown, before SIGTERM
CHILD_STOP_TIMEOUT_S = 10.0  # after SIGTERM, before SIGKILL


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


def default_model_dir() -> str:
    """The embedded default model's directory, as printed by executor_svc.default_model."""
    done = subprocess.run([sys.executable, "-m", "executor_svc.default_model"],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        raise ModelDirError("could not prepare the default model "
                            f"(exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return lines[-1].strip()


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


async def _serve(config: SchedulerConfig, spawn_executor: bool) -> int:
    try:
        model = config.model
        if model is None:
            if not spawn_executor:
                log.error("--model is required: pass a checkpoint directory or hub id")
                return 2
            model = await asyncio.to_thread(default_model_dir)
        model_dir = await asyncio.to_thread(resolve_model_dir, model)
        tokenizer = await asyncio.to_thread(Tokenizer, model_dir)
    except (ModelDirError, OSError, ValueError) as e:
        log.error("cannot load the model's tokenizer", error=str(e))
        return 1
    tune_garbage_collector()
    address = config.executor_address or (
        "tcp://127.0.0.1:*" if spawn_executor else DEFAULT_EXECUTOR_ADDRESS)
    try:
        channel = SchedulerEnd(address)
    except zmq.ZMQError as e:
        log.error("cannot bind the executor address", address=address, error=str(e))
        return 1
    try:
        server = SchedulerServer(config, tokenizer, channel)
    except RuntimeError as e:
        channel.close()
        log.error("cannot bind the gRPC port; is another server running there?",
                  address=config.grpc_address, error=str(e))
        return 1
    await server.start()
    log.info("scheduler listening", grpc_address=f"{config.host}:{server.port}",
             executor_address=channel.address, model_dir=str(model_dir))
    child = None
    try:
        if spawn_executor:
            child = await _spawn_executor(config, str(model_dir), channel.address)
        return await _wait_for_shutdown(server, child)
    finally:
        await server.stop()
        if child is not None:
            await _end_child(child)
        channel.close()
        log.info("scheduler stopped")


async def _spawn_executor(config: SchedulerConfig, model_dir: str, address: str
                          ) -> asyncio.subprocess.Process:
    cmd = [sys.executable, "-m", "executor_svc", "--model", model_dir,
           "--scheduler-address", address, "--log-format", config.log_format,
           "--log-level", config.log_level,
           *config.executor_flags()]
    child = await asyncio.create_subprocess_exec(*cmd)
    log.info("executor started", pid=child.pid, args=" ".join(cmd[3:]))
    return child


async def _wait_for_shutdown(server: SchedulerServer,
                             child: asyncio.subprocess.Process | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waits = {asyncio.create_task(stop.wait()), asyncio.create_task(server.wait_engine())}
    child_wait = asyncio.create_task(child.wait()) if child is not None else None
    if child_wait is not None:
        waits.add(child_wait)
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if child_wait is not None and child_wait in done:
        # Nobody restarts a child we own: without it the server can only refuse work.
        log.error("executor exited; shutting down", returncode=child.returncode)
        return 1
    log.info("shutting down")
    return 0


async def _end_child(child: asyncio.subprocess.Process) -> None:
    """The engine has sent Shutdown: give the child a moment to exit on its own, then
    SIGTERM, then SIGKILL."""
    for action, timeout in ((None, CHILD_EXIT_GRACE_S), (child.terminate, CHILD_STOP_TIMEOUT_S),
                            (child.kill, None)):
        if child.returncode is not None:
            break
        if action is not None:
            if action == child.kill:
                log.warning("executor ignored SIGTERM; killing it", pid=child.pid)
            with contextlib.suppress(ProcessLookupError):
                action()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.wait(), timeout)
    log.info("executor ended", returncode=child.returncode)
