"""The tensor-parallel launcher's arguments and the flag's validation (the ranks themselves run
in tests/e2e/models/test_e2e_tensor_parallel.py and the layer tests)."""

from __future__ import annotations

import os

import pytest

from executor_svc.cli import build_parser, config_from_args
from executor_svc.parallel.tp_launch import rank_argv
from scheduler_svc.config import SchedulerConfig


def test_rank_argv_takes_the_launchers_pid_and_shares_the_cores():
    argv = ["--model", "m", "--parent-pid", "17", "--tensor-parallel-size", "2"]
    out = rank_argv(argv, 2, cpu_threads=None)
    assert out[:4] == ["--model", "m", "--tensor-parallel-size", "2"]
    assert out[4:6] == ["--parent-pid", str(os.getpid())]
    assert out[6] == "--cpu-threads" and int(out[7]) >= 1
    out = rank_argv(["--parent-pid=17", "--cpu-threads", "3"], 4, cpu_threads=3)
    assert out == ["--cpu-threads", "3", "--parent-pid", str(os.getpid())]


@pytest.mark.parametrize("value", ["0", "-1", "513"])
def test_a_bad_tensor_parallel_size_is_refused_with_the_flag_named(value):
    args = build_parser().parse_args(["--tensor-parallel-size", value])
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        config_from_args(args)
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        SchedulerConfig(tensor_parallel_size=int(value))


def test_serve_passes_the_size_to_its_executor():
    flags = SchedulerConfig(tensor_parallel_size=2).executor_flags()
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in SchedulerConfig().executor_flags()


def test_a_follower_ends_the_group_on_a_frame_it_cannot_run(monkeypatch):
    """The rank channel is internal: a frame a follower cannot run (bad kind, undecodable
    plan, a message that is no plan) would desync the collectives, so it is GroupBroken."""
    import torch

    from executor_svc.parallel import tp_worker
    from protos.channel import encode
    from protos.plan import Shutdown, StepPlan

    for frame in (b"X", tp_worker.STEP + b"\xc1garbage", tp_worker.STEP + encode(Shutdown())):
        frames = iter([tp_worker.HEARTBEAT, frame])
        monkeypatch.setattr(tp_worker, "broadcast_bytes",
                            lambda data, device, frames=frames: next(frames))
        ran = []
        with pytest.raises(tp_worker.GroupBroken, match="bad control frame"):
            tp_worker.follow(ran.append, lambda: None, torch.device("cpu"))
        assert not ran
    frames = iter([tp_worker.STEP + encode(StepPlan(step_id=3)), tp_worker.CLEAR, tp_worker.STOP])
    monkeypatch.setattr(tp_worker, "broadcast_bytes", lambda data, device: next(frames))
    ran, cleared = [], []
    tp_worker.follow(ran.append, lambda: cleared.append(1), torch.device("cpu"))
    assert [p.step_id for p in ran] == [3] and cleared == [1]
