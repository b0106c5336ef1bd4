"""`folio serve`: the executor as a child process, restarted when it dies.

    spawn --> handshake --> serving --(exit, or lost and silent)--> backoff --> spawn ...

The engine keeps every request of a lost executor (registry.py) and resumes them on the next
one, so a restart costs the clients a pause, not their streams. Restarts back off
(`BACKOFF_S` doubling up to `MAX_BACKOFF_S`) and stop after `max_restarts` crashes in a row:
an executor that served for `STABLE_S` before dying starts the count afresh. An executor that
cannot run at all gives up at once: exit code 2 (the scheduler rejected it: versions or model
differ) or 1 (it failed to start: a bad checkpoint, a bad flag). An executor the engine lost
while its process lives on (no result within --executor-timeout) gets `RECONNECT_GRACE_S` to
say Hello again, then is killed and replaced.

The child learns the channel secret from its environment (not argv, which `ps` shows) and its
parent's pid (`--parent-pid`), so it exits when the scheduler dies, even by SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time

import structlog

from protos.channel_keys import SECRET_ENV

log = structlog.get_logger("folio.scheduler.supervisor")

BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0
RECONNECT_GRACE_S = 10.0
EXIT_FAILED_TO_START, EXIT_REJECTED = 1, 2
STOP_GRACE_S = 0.7  # after Shutdown, before SIGTERM; then as long again before SIGKILL


class ExecutorSupervisor:
    def __init__(self, model_dir: str, address: str, flags: list[str], secret: str | None,
                 max_restarts: int, log_format: str, log_level: str):
        self.cmd = [sys.executable, "-m", "executor_svc", "--model", model_dir,
                    "--scheduler-address", address, "--parent-pid", str(os.getpid()),
                    "--log-format", log_format, "--log-level", log_level, *flags]
        self.env = dict(os.environ)
        if secret is not None:
            self.env[SECRET_ENV] = secret
        self.max_restarts = max_restarts
        self.child: asyncio.subprocess.Process | None = None
        self.num_restarts = 0
        self._connected_at: float | None = None
        self._ever_connected = False
        self._lost = asyncio.Event()
        self._stopping = False

    async def on_executor_change(self, connected: bool, reason: str) -> None:
        """The engine's view of the connection (a callback from Engine)."""
        if connected:
            self._connected_at = time.monotonic()
            self._ever_connected = True
            self._lost.clear()
        else:
            self._lost.set()

    async def run(self) -> int:
        """Keep an executor running; returns an exit code for the server once it gives up."""
        consecutive = 0
        while not self._stopping:
            self._lost.clear()
            self._connected_at, self._ever_connected = None, False
            self.child = await asyncio.create_subprocess_exec(*self.cmd, env=self.env)
            log.info("executor started", pid=self.child.pid, args=" ".join(self.cmd[3:]))
            returncode = await self._watch(self.child)
            if self._stopping:
                return 0
            served_s = (time.monotonic() - self._connected_at) if self._connected_at else 0.0
            if returncode in (EXIT_FAILED_TO_START, EXIT_REJECTED) and not self._ever_connected:
                log.error("executor cannot run; not restarting it", returncode=returncode,
                          hint="see the executor's error above")
                return 1
            consecutive = 1 if served_s >= STABLE_S else consecutive + 1
            if consecutive > self.max_restarts:
                log.error("executor keeps crashing; giving up", returncode=returncode,
                          restarts=self.num_restarts, max_restarts=self.max_restarts)
                return 1
            delay = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (consecutive - 1))
            log.error("executor exited; restarting it", returncode=returncode,
                      attempt=consecutive, max_restarts=self.max_restarts, delay_s=delay)
            self.num_restarts += 1
            await asyncio.sleep(delay)
        return 0

    async def _watch(self, child: asyncio.subprocess.Process) -> int:
        """Wait until the child exits; kill it if the engine lost it and it stays silent."""
        exited = asyncio.ensure_future(child.wait())
        try:
            while True:
                lost = asyncio.ensure_future(self._lost.wait())
                done, _ = await asyncio.wait({exited, lost}, return_when=asyncio.FIRST_COMPLETED)
                lost.cancel()
                if exited in done:
                    return exited.result()
                # Lost but alive (hung, or a step beyond --executor-timeout): a live executor
                # says Hello again by itself; give it the grace to, then replace it.
                deadline = time.monotonic() + RECONNECT_GRACE_S
                while self._lost.is_set() and not exited.done() and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                if exited.done():
                    return exited.result()
                if self._lost.is_set():
                    log.error("executor lost but still running; killing it", pid=child.pid)
                    with contextlib.suppress(ProcessLookupError):
                        child.kill()
                    return await exited
        finally:
            exited.cancel()

    async def stop(self) -> None:
        """The engine has sent Shutdown: give the child a moment to exit on its own, then
        SIGTERM, then SIGKILL."""
        self._stopping = True
        child = self.child
        if child is None:
            return
        for action in (None, child.terminate, child.kill):
            if child.returncode is not None:
                break
            if action is not None:
                if action == child.kill:
                    log.warning("executor ignored SIGTERM; killing it", pid=child.pid)
                with contextlib.suppress(ProcessLookupError):
                    action()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child.wait(), STOP_GRACE_S)
        log.info("executor ended", returncode=child.returncode)
