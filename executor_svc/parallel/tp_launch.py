"""Start the ranks of a tensor-parallel executor on this node (what torchrun does, on one node).

`folio executor --tensor-parallel-size N` with no torchrun variables in its environment becomes
this launcher: it starts N processes of the same command with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, each watching the launcher as its parent (so none
outlives it), and then watches them. The ranks are one executor: when any of them ends, the
others are ended too (rank 0 ends the group itself on a clean shutdown; otherwise they get
SIGTERM, then SIGKILL) and the launcher exits with rank 0's code, or 1 when another rank
failed, so `folio serve`'s supervisor restarts the whole executor. Across nodes, start
`python -m executor_svc --tensor-parallel-size N ...` under torchrun instead (README).

Imports no torch: the launcher only starts and watches processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import structlog

from executor_svc.cpu_threads import default_cpu_threads
from executor_svc.lifecycle import ShutdownRequested

log = structlog.get_logger(__name__)

POLL_S = 0.1
GRACE_S = 5.0  # for the other ranks to end on their own, then as long after SIGTERM


def torchrun_env_set() -> bool:
    return "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_argv(argv: list[str], world_size: int, cpu_threads: int | None) -> list[str]:
    """The launcher's own arguments for a rank: its --parent-pid replaced by the launcher's,
    and the node's cores shared between the ranks unless --cpu-threads says otherwise."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--parent-pid":
            skip = True
            continue
        if not arg.startswith("--parent-pid="):
            out.append(arg)
    out += ["--parent-pid", str(os.getpid())]
    if cpu_threads is None:
        out += ["--cpu-threads", str(max(1, default_cpu_threads() // world_size))]
    return out


def launch(argv: list[str], world_size: int, cpu_threads: int | None) -> int:
    """Run the ranks until one ends; returns the executor's exit code."""
    port = free_port()
    args = [sys.executable, "-m", "executor_svc", *rank_argv(argv, world_size, cpu_threads)]
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen(args, env=env))
        log.info("tensor-parallel ranks started", world_size=world_size, master_port=port,
                 pids=[p.pid for p in procs])
        while True:
            ended = [(rank, p.returncode) for rank, p in enumerate(procs) if p.poll() is not None]
            if ended:
                break
            time.sleep(POLL_S)
    except ShutdownRequested:
        _end(procs, grace_s=0.0)
        raise
    rank, code = ended[0]
    log.info("a tensor-parallel rank ended; ending the others", rank=rank, returncode=code)
    _end(procs, grace_s=GRACE_S if rank == 0 and code == 0 else 0.0)
    if rank == 0:
        return code
    return code if code not in (0, None) else 1


def _end(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Let the ranks end by themselves for grace_s, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
