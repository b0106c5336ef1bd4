"""Tensor parallelism's process group: torch.distributed, NCCL on CUDA and gloo on the CPU.

Every executor rank joins one group (the default process group) before its model is built;
the group is the tensor-parallel group (there is no pipeline or data parallelism inside an
executor). Ranks find each other through torchrun's environment variables (`RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), whoever set them: torchrun across
nodes, or `executor_svc.parallel.tp_launch` on one node.

Without a group (one rank) every helper here is the identity, so a model built for one rank
runs no collective and imports nothing it does not use.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

# A collective that waits longer than this fails (gloo raises; NCCL's watchdog aborts): a rank
# that died mid-step never leaves the others hanging.
COLLECTIVE_TIMEOUT_S = 120.0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def env_world() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun's variables, None when they are unset."""
    if "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def init_tp(world_size: int, device_type: str,
            timeout_s: float = COLLECTIVE_TIMEOUT_S) -> tuple[int, int]:
    """Join the group torchrun's variables describe, checked against `world_size` (the
    --tensor-parallel-size flag); returns (rank, local_rank). CUDA ranks take the device of
    their local rank."""
    found = env_world()
    if found is None:
        raise ValueError(f"--tensor-parallel-size {world_size} needs RANK, WORLD_SIZE, "
                         "MASTER_ADDR and MASTER_PORT (start the ranks with torchrun, or let "
                         "`folio executor` start them on this node)")
    rank, world, local_rank = found
    if world != world_size:
        raise ValueError(f"--tensor-parallel-size {world_size} but WORLD_SIZE={world}")
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, local_rank


def shutdown_tp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns it."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_to_first(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Rank 0: the ranks' `x` concatenated along `dim` in rank order; other ranks: None."""
    world = tp_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)] if tp_rank() == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=dim) if parts is not None else None


def broadcast_tensor(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank src's `x` into every rank's `x` (same shape and dtype everywhere), in place."""
    if tp_size() > 1:
        dist.broadcast(x, src)
    return x


def broadcast_bytes(data: bytes | None, device: torch.device) -> bytes:
    """Rank 0's `data` to every rank (the others pass None): a length, then the bytes."""
    if tp_size() == 1:
        assert data is not None
        return data
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if tp_rank() == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0)
    return data if tp_rank() == 0 else bytes(buf.cpu().numpy())


def barrier(device: torch.device) -> None:
    """Return once every rank has called it (an all-reduce, which NCCL and gloo both run on
    the ranks' own devices)."""
    if tp_size() > 1:
        dist.all_reduce(torch.zeros(1, dtype=torch.int64, device=device))


def all_reduce_min(value: int, device: torch.device) -> int:
    """The minimum of an int over the ranks."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
