"""How the executor ends: on SIGTERM/SIGINT, and when the process that started it is gone.

`Lifecycle.install()` runs in `cli.main()` before torch is imported, so a signal during the
multi-second import or model load is handled like one during serving.

- **SIGTERM, SIGINT.** A Python handler raises `ShutdownRequested` in the main thread, wherever
  it is: importing torch, reading weights, blocked in a ZeroMQ poll (pyzmq sees EINTR, runs the
  handler and re-raises what it raised), or between two ops of a step. It derives from
  BaseException so the step loop's ``except Exception`` cannot swallow it. `cli.main()` catches
  it, the worker's ``finally`` has closed the socket, and the exit code is 0. The explicit handler
  is also what makes SIGTERM work for PID 1 in a container: the kernel applies no default action
  to a signal sent to a PID namespace's init, so without one `podman stop` waits for SIGKILL.
- **Watchdog.** Python runs handlers only between bytecodes, so a main thread inside one long
  C call (a huge matmul) would not see the signal until the call returns. `signal.set_wakeup_fd`
  makes the C-level handler write the signal number to a pipe even then; a daemon thread reading
  it ends the process with ``os._exit(0)`` if it is still alive `SHUTDOWN_GRACE_S` later. That
  thread needs the GIL, which torch ops, ZeroMQ and file reads release while they run; a C loop
  that keeps the GIL delays both until it returns.
- **--parent-pid.** The executor also ends when that process is gone. When it is the direct
  parent, Linux's PR_SET_PDEATHSIG has the kernel signal us the moment it dies; a daemon thread
  polling every `PARENT_POLL_S` covers other systems, a parent that is not the direct one, and a
  parent that died before prctl ran. The death signal is `PARENT_DEATH_SIGNAL`, not SIGTERM: the
  kernel sends it when the parent *thread* that forked us exits, which may happen while the
  parent process lives on, so its handler first checks that the parent is really gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PARENT_DEATH_SIGNAL = signal.SIGUSR2
SHUTDOWN_GRACE_S = 1.0  # from the signal to os._exit when the main thread cannot unwind
PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ShutdownRequested(BaseException):  # noqa: N818 - a request, not an error
    """Raised in the main thread by a shutdown signal; not an Exception, so no ``except
    Exception`` on the way up (the step loop has one) stops it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Lifecycle:
    """Signal handlers, the watchdog and the parent watcher of one executor process.

    Invariants: at most one ShutdownRequested is ever raised (later signals find `_raised` set
    and return, so none can escape the code that is already unwinding from the first); and once
    a shutdown signal arrived, the process is gone within SHUTDOWN_GRACE_S whatever the main
    thread is doing, short of a C loop that never releases the GIL.
    """

    def __init__(self, parent_pid: int | None = None):
        self.parent_pid = parent_pid
        # Decided once: a process that was our parent and no longer is has died (we were
        # reparented), which is exact where a pid lookup could be fooled by pid reuse.
        self._was_direct_parent = parent_pid is not None and os.getppid() == parent_pid
        self._raised = False
        self._main_thread_id = threading.main_thread().ident
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_write, False)  # the C handler must never block

    def install(self) -> None:
        """Call from the main thread, before anything slow."""
        for sig in SHUTDOWN_SIGNALS:
            signal.signal(sig, self._on_shutdown_signal)
        signal.set_wakeup_fd(self._wakeup_write, warn_on_full_buffer=False)
        threading.Thread(target=self._watchdog, name="shutdown-watchdog", daemon=True).start()
        if self.parent_pid is None:
            return
        signal.signal(PARENT_DEATH_SIGNAL, self._on_parent_death_signal)
        if self._was_direct_parent:
            set_parent_death_signal(PARENT_DEATH_SIGNAL)
        # Its first check runs now: a parent that died before prctl is noticed at once.
        threading.Thread(target=self._watch_parent, name="parent-watcher", daemon=True).start()

    def parent_alive(self) -> bool:
        pid = self.parent_pid
        if pid is None or os.getppid() == pid:
            return True
        if self._was_direct_parent:
            return False
        return _pid_alive(pid)

    def _on_shutdown_signal(self, signum: int, _frame) -> None:
        self._raise(signal.Signals(signum).name)

    def _on_parent_death_signal(self, _signum: int, _frame) -> None:
        if not self.parent_alive():
            self._raise(f"parent process {self.parent_pid} exited")

    def _raise(self, reason: str) -> None:
        if self._raised:
            return
        self._raised = True
        raise ShutdownRequested(reason)

    def _watch_parent(self) -> None:
        while self.parent_alive():
            time.sleep(PARENT_POLL_S)
        # At the main thread, so a blocking call there is interrupted (EINTR) and the handler
        # runs now; a process-wide signal could land in this thread and leave main asleep.
        signal.pthread_kill(self._main_thread_id, PARENT_DEATH_SIGNAL)

    def _watchdog(self) -> None:
        shutdown_bytes = {int(s) for s in SHUTDOWN_SIGNALS}
        while True:
            try:
                woken_by = set(os.read(self._wakeup_read, 64))
            except OSError:
                return
            if woken_by & shutdown_bytes:
                break
            if int(PARENT_DEATH_SIGNAL) in woken_by and not self.parent_alive():
                break
        time.sleep(SHUTDOWN_GRACE_S)
        # Still here: the main thread is stuck where no Python handler runs. Raw write: the
        # logger's lock might be held by that very thread.
        with contextlib.suppress(OSError):
            os.write(2, f"executor did not stop within {SHUTDOWN_GRACE_S:g} s of the shutdown "
                        "signal; exiting now\n".encode())
        os._exit(0)


def set_parent_death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig) through libc; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)), ctypes.c_ulong(0),
                          ctypes.c_ulong(0), ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    # A killed process stays visible as a zombie until its own parent reaps it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
