"""Tensor-parallel test groups: real processes joined by gloo on 127.0.0.1.

`run_ranks(fn, world_size, *args)` spawns `world_size` processes; each joins the group through
torchrun's variables and `distributed.init_tp`, runs ``fn(rank, *args)`` with one torch thread
(the test machine has two cores), and leaves the group. A rank's exception fails the call with
its traceback; a group that outlives `timeout_s` is killed (by the pids this call started).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    faulthandler.enable()  # a rank killed by a signal still shows where it was
    from executor_svc.parallel import distributed

    distributed.init_tp(world_size, "cpu", timeout_s=60.0)
    try:
        fn(rank, *args)
    finally:
        distributed.shutdown_tp()
    # A clean rank leaves without interpreter teardown: gloo's threads can outlive
    # destroy_process_group, and finalizing with them alive sometimes aborts ("terminate called
    # without an active exception", SIGABRT) after the work is done. A failed rank raises
    # instead, so spawn reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = GROUP_TIMEOUT_S) -> None:
    """Run ``fn(rank, *args)`` on every rank of a fresh group; `fn` must be importable (a
    module-level function) since ranks are spawned."""
    ctx = mp.start_processes(_rank_main, args=(world_size, free_port(), fn, args),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel group of {world_size} ranks still running "
                                   f"after {timeout_s:.0f} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
