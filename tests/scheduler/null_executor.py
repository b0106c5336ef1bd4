"""A null-model executor for scheduler tests: it follows the step-plan protocol exactly and
checks every plan, but "samples" with a deterministic rule instead of running a model.

`PlanMirror` is the executor's view of the requests, rebuilt from plans alone; it raises
`PlanViolation` on any plan the real executor could not execute (unknown request, wrong
computed count, block table too short, a write into a shared block, a read of KV that is not
the request's own). `NullExecutor` runs a PlanMirror (or another mirror, such as
tests.scheduler.kv_mirror.KVMirror) behind a real `protos.channel.ExecutorEnd` in a thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from protos.channel import ExecutorEnd, SchedulerLost
from protos.channel_keys import ChannelKeys
from protos.plan import (
    PROTOCOL_VERSION,
    ExecutorError,
    Hello,
    Reject,
    Shutdown,
    StepPlan,
    StepResult,
    Welcome,
)


class PlanViolation(AssertionError):
    pass


@dataclass
class MirroredRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int = 0


def next_token(token_ids: list[int]) -> int:
    """The null model: a fixed function of the sequence, never a special id (< 10)."""
    return 10 + (sum(token_ids) * 7 + len(token_ids)) % 200


Slot = tuple[int, int] | None  # (token id, position) whose "KV" a slot holds


@dataclass
class PlanMirror:
    """Also simulates the KV pools: each slot records the (token id, position) written there;
    swaps and copies move slots like the real executor (offload_out to the host tier,
    swap_out, swap_in, offload_in, then copies, all before the forward pass). A request that samples must read back exactly its own tokens
    through its block table, and no step may write into a block another request holds.

    KV groups (`windows`, as the executor's Hello states them): a table holds one block per
    group per position, interleaved; every token is written in each group's block. A windowed
    group's request holds, and reads back, only the positions the window of its queries this
    step can see (from num_computed - W + 1 at the step's start); entries below them may name
    blocks the scheduler released and handed to someone else."""

    block_size: int
    sample: Callable[[str, list[int]], int] = lambda req_id, ids: next_token(ids)
    reqs: dict[str, MirroredRequest] = field(default_factory=dict)
    num_plans: int = 0
    gpu: dict[int, list[Slot]] = field(default_factory=dict)
    cpu: dict[int, list[Slot]] = field(default_factory=dict)
    host: dict[int, list[Slot]] = field(default_factory=dict)  # the prefix cache's host tier
    num_offloaded_in: int = 0  # blocks copied back from the host tier so far
    num_swapped_out: int = 0  # blocks moved to the CPU pool so far
    num_copied: int = 0
    failed_req_ids: set[str] = field(default_factory=set)  # of the last step, if it failed
    windows: tuple[int, ...] = (0,)
    _first_query: dict[str, int] = field(default_factory=dict)  # this step's, per request

    def _held(self, req: MirroredRequest, first_query: int) -> set[int]:
        """The blocks `req` holds while its queries start at `first_query`."""
        G, bs = len(self.windows), self.block_size
        held = set()
        for i, block_id in enumerate(req.block_ids):
            w = self.windows[i % G]
            if not w or i // G >= max(0, first_query - w + 1) // bs:
                held.add(block_id)
        return held

    def apply(self, plan: StepPlan) -> StepResult:
        self.num_plans += 1
        # Like the real executor: the plan queued behind a failed step skips its requests.
        failed, self.failed_req_ids = self.failed_req_ids, set()
        if failed and not plan.reset:
            plan = replace(plan, new_reqs=[r for r in plan.new_reqs if r.req_id not in failed],
                           cached_reqs=[r for r in plan.cached_reqs if r.req_id not in failed])
        if plan.reset:  # the scheduler rebuilt its state: whatever the executor held is gone
            self.reqs.clear()
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            if self.reqs.pop(req_id, None) is None:
                raise PlanViolation(f"step {plan.step_id}: dropping unknown request {req_id}")
        self._move(plan)
        scheduled: list[tuple[str, int]] = []
        for new in plan.new_reqs:
            old = self.reqs.get(new.req_id)
            if old is not None and (old.num_computed_tokens != new.num_computed_tokens
                                    or new.token_ids[:len(old.token_ids)] != old.token_ids):
                raise PlanViolation(f"step {plan.step_id}: {new.req_id} re-sent as new with "
                                    "a state that contradicts the executor's copy")
            self.reqs[new.req_id] = MirroredRequest(list(new.token_ids), list(new.block_ids),
                                                    new.num_computed_tokens)
            scheduled.append((new.req_id, new.num_scheduled_tokens))
        for cached in plan.cached_reqs:
            req = self.reqs.get(cached.req_id)
            if req is None:
                raise PlanViolation(f"step {plan.step_id}: cached request {cached.req_id} "
                                    "was never sent as new")
            if cached.num_computed_tokens != req.num_computed_tokens:
                raise PlanViolation(f"step {plan.step_id}: {cached.req_id} computed count "
                                    f"{cached.num_computed_tokens} != {req.num_computed_tokens}")
            req.block_ids.extend(cached.new_block_ids)
            scheduled.append((cached.req_id, cached.num_scheduled_tokens))
        if len({r for r, _ in scheduled}) != len(scheduled):
            raise PlanViolation(f"step {plan.step_id}: a request is scheduled twice")
        # Where each request's queries start this step: what its windows still hold.
        self._first_query = {r: q.num_computed_tokens for r, q in self.reqs.items()}
        for req_id, num_scheduled in scheduled:
            self._write(plan.step_id, req_id, num_scheduled)
        sampled: list[tuple[str, list[int]]] = []
        for req_id, _ in scheduled:
            req = self.reqs[req_id]
            if req.num_computed_tokens == len(req.token_ids):
                self._check_reads(plan.step_id, req_id)
                token = self.sample(req_id, req.token_ids)
                req.token_ids.append(token)
                sampled.append((req_id, [token]))
        return StepResult(step_id=plan.step_id, sampled=sampled)

    def _move(self, plan: StepPlan) -> None:
        empty = [None] * self.block_size
        for what, pairs in (("host slot", plan.offload_out), ("block", plan.offload_in)):
            if len({d for _, d in pairs}) != len(pairs):
                raise PlanViolation(f"step {plan.step_id}: two copies into one {what}")
        if len({slot for slot, _ in plan.offload_in}) != len(plan.offload_in):
            raise PlanViolation(f"step {plan.step_id}: one host slot copied in twice")
        for gpu_id, slot in plan.offload_out:
            self.host[slot] = list(self.gpu.get(gpu_id, empty))
        for gpu_id, cpu_id in plan.swap_out:
            self.cpu[cpu_id] = list(self.gpu.get(gpu_id, empty))
        for cpu_id, gpu_id in plan.swap_in:
            self.gpu[gpu_id] = list(self.cpu.get(cpu_id, empty))
        for slot, gpu_id in plan.offload_in:
            self.gpu[gpu_id] = list(self.host.get(slot, empty))
        self.num_offloaded_in += len(plan.offload_in)
        if len({d for _, d in plan.block_copies}) != len(plan.block_copies):
            raise PlanViolation(f"step {plan.step_id}: two copies into one block")
        sources = [list(self.gpu.get(s, empty)) for s, _ in plan.block_copies]
        for (_, dst), slots in zip(plan.block_copies, sources, strict=True):
            self.gpu[dst] = slots
        self.num_swapped_out += len(plan.swap_out)
        self.num_copied += len(plan.block_copies)

    def _write(self, step_id: int, req_id: str, num_scheduled: int) -> None:
        req = self.reqs[req_id]
        end = req.num_computed_tokens + num_scheduled
        if num_scheduled < 1 or end > len(req.token_ids):
            raise PlanViolation(f"step {step_id}: {req_id} schedules {num_scheduled} "
                                f"tokens from {req.num_computed_tokens} of {len(req.token_ids)}")
        G, bs = len(self.windows), self.block_size
        if len(req.block_ids) % G or len(req.block_ids) // G * bs < end:
            raise PlanViolation(f"step {step_id}: {req_id} has {len(req.block_ids)} block "
                                f"entries for {end} tokens in {G} KV groups")
        written = {req.block_ids[p // bs * G + g] for p in range(req.num_computed_tokens, end)
                   for g in range(G)}
        for other_id, other in self.reqs.items():
            if other_id == req_id:
                continue
            held = self._held(other, self._first_query.get(other_id, other.num_computed_tokens))
            if shared := written & held:
                raise PlanViolation(f"step {step_id}: {req_id} writes into blocks {shared} "
                                    f"that {other_id} holds")
        for p in range(req.num_computed_tokens, end):
            for g in range(G):
                self.gpu.setdefault(req.block_ids[p // bs * G + g], [None] * bs)[p % bs] = \
                    (req.token_ids[p], p)
        req.num_computed_tokens = end

    def _check_reads(self, step_id: int, req_id: str) -> None:
        req, bs, G = self.reqs[req_id], self.block_size, len(self.windows)
        first_query = self._first_query.get(req_id, 0)
        for g, w in enumerate(self.windows):
            first = max(0, first_query - w + 1) if w else 0
            for p in range(first, len(req.token_ids)):
                token_id = req.token_ids[p]
                block_id = req.block_ids[p // bs * G + g]
                slot = self.gpu.get(block_id, [None] * bs)[p % bs]
                if slot != (token_id, p):
                    raise PlanViolation(f"step {step_id}: {req_id} reads {slot} at position "
                                        f"{p} (group {g}, block {block_id}), expected "
                                        f"{(token_id, p)}")

    def fail(self, plan: StepPlan) -> ExecutorError:
        """Fail the step: like the real executor, keep no state for its requests."""
        self.num_plans += 1
        if plan.reset:  # the scheduler rebuilt its state: whatever the executor held is gone
            self.reqs.clear()
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for req in plan.new_reqs + plan.cached_reqs:
            self.reqs.pop(req.req_id, None)
        self.failed_req_ids = {r.req_id for r in plan.new_reqs + plan.cached_reqs}
        return ExecutorError(step_id=plan.step_id, message="simulated CUDA error")


def make_hello(**overrides) -> Hello:
    facts = dict(protocol_version=PROTOCOL_VERSION, executor_id="null-0",
                 model_name="tiny", architecture="LlamaForCausalLM", vocab_size=512,
                 max_model_len=64, block_size=4, num_kv_blocks=32, num_swap_blocks=0,
                 dtype="float32", device="cpu", random_weights=True)
    return Hello(**{**facts, **overrides})


class NullExecutor(threading.Thread):
    """Connects, says Hello, answers plans until Shutdown/stop(). `step_delay_s` slows steps
    (so tests can act mid-generation); `fail_step` makes a step answer ExecutorError;
    `go_silent_after` stops answering after that many plans (an executor that hung); `mirror`
    answers the plans (default: a PlanMirror for the Hello's block size)."""

    def __init__(self, address: str, hello: Hello | None = None, step_delay_s: float = 0.0,
                 fail_step: int | None = None, go_silent_after: int | None = None,
                 keys: ChannelKeys | None = None, mirror=None):
        super().__init__(daemon=True)
        self.keys = keys
        self.address = address
        self.hello = hello or make_hello()
        self.mirror = mirror if mirror is not None else PlanMirror(
            self.hello.block_size, windows=tuple(self.hello.kv_windows))
        self.step_delay_s = step_delay_s
        self.fail_step = fail_step
        self.go_silent_after = go_silent_after
        self.reply: Welcome | Reject | None = None
        self._replied = threading.Event()
        self.violation: PlanViolation | None = None
        self.got_shutdown = False
        self.lost_scheduler = False
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def wait_reply(self, timeout: float = 10.0) -> Welcome | Reject | None:
        """The handshake's answer once this thread has read it. The scheduler reports SERVING
        (or tells the old executor to shut down) right after *sending* Welcome, so a test that
        reads `reply` then, without waiting, races this thread's recv."""
        self._replied.wait(timeout)
        return self.reply

    def run(self) -> None:
        end = ExecutorEnd(self.address, self.keys)
        try:
            end.wait_connected(10_000)
            end.send(self.hello)
            self.reply = end.recv(timeout_ms=10_000)
            self._replied.set()
            if not isinstance(self.reply, Welcome):
                return
            while not self._stop_event.is_set():
                msg = end.recv(timeout_ms=50)
                match msg:
                    case None:
                        continue
                    case Shutdown():
                        self.got_shutdown = True
                        return
                    case SchedulerLost():
                        self.lost_scheduler = True
                        return
                    case StepPlan():
                        if (self.go_silent_after is not None
                                and self.mirror.num_plans >= self.go_silent_after):
                            continue
                        self._stop_event.wait(self.step_delay_s)
                        if msg.step_id == self.fail_step:
                            end.send(self.mirror.fail(msg))
                            continue
                        try:
                            end.send(self.mirror.apply(msg))
                        except PlanViolation as e:
                            self.violation = e
                            end.send(ExecutorError(step_id=msg.step_id, message=str(e)))
        finally:
            self._replied.set()
            end.close()
