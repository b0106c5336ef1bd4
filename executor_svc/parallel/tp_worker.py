"""Tensor-parallel ranks in step: rank 0 leads, the others follow.

Only rank 0 talks to the scheduler. Before it runs a plan it broadcasts the plan (exactly the
plan it runs, after its own filtering) to the other ranks, which run it too: every rank holds
the same persistent batch and the same block tables, and the model's collectives pair up
because every rank executes the same sequence of steps. Only rank 0 has the logits, so only
it samples; it shares the sampled ids (or that sampling failed) with every rank after each
step, and every rank appends them alike.

    rank 0:  recv plan -> broadcast [STEP, plan] -> execute (collectives) -> sample -> share ids
    rank k:  broadcast -> execute (collectives) -> receive ids (or the abort)

Failures: a plan the runner refuses (`PlanError`) is refused before any collective, alike on
every rank, and the ranks go on. A failure inside the forward (`GroupBroken`) may leave the
ranks at different collectives: the rank that sees it exits, the others' collectives fail
within `distributed.COLLECTIVE_TIMEOUT_S` (at once with gloo, when a peer closes), and the
launcher ends every rank so the supervisor restarts the executor and the scheduler resumes its
requests. While idle, rank 0 broadcasts a heartbeat every few seconds so a waiting follower's
broadcast never times out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import structlog
import torch

from executor_svc.parallel.distributed import broadcast_bytes, broadcast_tensor, tp_rank, tp_size
from protos.channel import ProtocolError, decode, encode
from protos.plan import StepPlan

log = structlog.get_logger(__name__)

STEP, CLEAR, HEARTBEAT, STOP = b"S", b"C", b"H", b"Q"

T = TypeVar("T")


class GroupBroken(RuntimeError):
    """A rank failed where the others may be inside a collective: the group cannot go on."""


class StepAborted(RuntimeError):
    """Rank 0 failed to sample this step; the other ranks drop it as rank 0 does."""


class Leader:
    """Rank 0's side of the control channel (a no-op with one rank)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.active = tp_size() > 1

    def _send(self, frame: bytes) -> None:
        if self.active:
            with collectives():
                broadcast_bytes(frame, self.device)

    def step(self, plan: StepPlan) -> None:
        self._send(STEP + encode(plan))

    def clear(self) -> None:
        self._send(CLEAR)

    def heartbeat(self) -> None:
        self._send(HEARTBEAT)

    def stop(self) -> None:
        self._send(STOP)


def follow(execute: Callable[[StepPlan], object], clear: Callable[[], None],
           device: torch.device) -> None:
    """A follower's loop: run what rank 0 broadcasts until STOP. Raises GroupBroken (the
    caller exits) on a failure the group cannot survive."""
    while True:
        with collectives():
            frame = broadcast_bytes(None, device)
        kind, body = frame[:1], frame[1:]
        if kind == HEARTBEAT:
            continue
        if kind == STOP:
            log.info("rank 0 stopped the group")
            return
        if kind == CLEAR:
            clear()
            continue
        try:
            plan = decode(body) if kind == STEP else None
        except ProtocolError as e:
            plan = None
            log.error("undecodable plan from rank 0", error=str(e)[:300])
        if not isinstance(plan, StepPlan):  # running anything else would desync the group
            raise GroupBroken(f"bad control frame from rank 0 (kind {kind!r})")
        if plan.reset:
            clear()
        try:
            execute(plan)
        except GroupBroken:
            raise
        except Exception as e:  # refused alike on rank 0, which answers the scheduler
            log.info("step failed on every rank", step=plan.step_id,
                     error=f"{type(e).__name__}: {e}"[:300])


@contextlib.contextmanager
def collectives() -> Iterator[None]:
    """Around the forward and other collectives: with several ranks, any failure inside is a
    GroupBroken."""
    try:
        yield
    except Exception as e:
        if tp_size() > 1:
            raise GroupBroken(f"rank {tp_rank()} failed inside the forward: "
                              f"{type(e).__name__}: {e}") from e
        raise


def share_sampled(sample: Callable[[], T], num_rows: int, device: torch.device,
                  from_ids: Callable[[list[int]], T]) -> T:
    """Rank 0 runs `sample()` (it alone has the logits) and sends every rank the sampled ids,
    which the others wrap with `from_ids`; if sampling fails on rank 0 every rank raises."""
    if tp_size() == 1:
        return sample()
    msg = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)  # [ok, ids...]
    if tp_rank() == 0:
        try:
            out = sample()
        except Exception:
            with collectives():
                broadcast_tensor(msg)  # ok = 0: every rank drops the step
            raise
        msg[0] = 1
        msg[1:] = torch.tensor(out.token_ids, dtype=torch.int64)  # type: ignore[attr-defined]
        with collectives():
            broadcast_tensor(msg)
        return out
    with collectives():
        broadcast_tensor(msg)
    host = msg.tolist()
    if not host[0]:
        raise StepAborted("rank 0 failed to sample this step")
    return from_ids(host[1:])
