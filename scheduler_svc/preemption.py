"""Preemption: making room in the KV pool when the running requests need more blocks than are
free (step 3 of `Scheduler.schedule`), and swapping swapped-out requests back in (step 4).

The newest running request goes first. The oldest is never preempted while another runs, and
any request fits the pool alone (`max_model_len` is capped to it), so the oldest always
finishes and every request eventually does. A step that preempted admits no one. A victim is

    swapped out   GPU table --swap_out pairs--> CPU table; the request joins `swapped` (sorted
                  by arrival) with its computed tokens intact and is swapped back in before any
                  waiting request is admitted;
    recomputed    its blocks are freed; it goes back to the front of `waiting` with
                  num_computed_tokens = 0 and is re-admitted with prompt + generated tokens as
                  its prompt (reusing what the prefix cache still holds);
    a beam        its whole search restarts from the prompt (`restart_beam_search`).

`preemption_mode` chooses between swap and recompute. A victim the executor holds leaves
`_executor_req_ids` and rides the next plan's `preempted_req_ids`. Swap-out and swap-in never
share a step: a step that preempted resumes no one.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import structlog

from scheduler_svc.request import Request, RequestStatus
from scheduler_svc.sequence_group import BeamGroup, num_seq_slots, restart_beam_search

if TYPE_CHECKING:
    from scheduler_svc.scheduler import Scheduler, _Step

log = structlog.get_logger("folio.scheduler.scheduler")  # the scheduler's decisions


def make_room(sched: Scheduler, wants: list[tuple[Request, int]], step: _Step
              ) -> list[tuple[Request, int]]:
    """Preempt the newest running requests until the blocks `wants` need are free; returns the
    wants of the requests still running."""
    bm = sched.block_manager
    while sum(bm.num_blocks_needed(r.req_id, r.num_computed_tokens + n)
              for r, n in wants) > bm.num_free_blocks:
        victim = sched.running[-1]  # non-empty: wants only holds running requests
        preempt(sched, victim, step)
        # Not just the victim: preempting a beam ends all beams of its search.
        wants = [(r, n) for r, n in wants if r.status is RequestStatus.RUNNING]
    return wants


def preemption_mode(sched: Scheduler, req: Request) -> str:
    """Swap or recompute? Recompute costs ~num_computed_tokens x the model's FLOPs per token
    (plus attention, quadratic in length); a swap moves num_blocks x bytes per block over PCIe
    twice (out and back in), and per token that is several times cheaper than recomputing on
    any model worth serving. So `auto` swaps whenever the CPU pool has room and the victim has
    at least one full block of computed KV; a shorter context is cheap to recompute and not
    worth a round trip or CPU space. `swap` swaps whenever the pool has room; `recompute` never
    swaps. Without room in the CPU pool, recompute."""
    bm = sched.block_manager
    if sched.preemption_mode == "recompute" or bm.num_cpu_blocks == 0:
        return "recompute"
    if bm.num_swap_out_blocks([req.req_id]) > bm.num_free_cpu_blocks:
        return "recompute"
    if sched.preemption_mode == "swap" or req.num_computed_tokens >= bm.block_size:
        return "swap"
    return "recompute"


def preempt(sched: Scheduler, req: Request, step: _Step) -> None:
    if isinstance(req.group, BeamGroup):
        # Beams share blocks and wait for each other every step: resumed one by one they
        # could hold blocks forever. The search restarts instead; greedy, it replays.
        log.info("beam search preempted: restarting it", req_id=req.group.req_id,
                 num_beams=len(req.group.beams))
        restart_beam_search(sched, req.group)
        sched.num_preemptions += 1
        step.preempted = True
        return
    mode = preemption_mode(sched, req)
    log.info("request preempted", req_id=req.req_id, mode=mode,
             num_computed_tokens=req.num_computed_tokens)
    sched.running.remove(req)
    if mode == "swap":
        step.swap_out.extend(sched.block_manager.swap_out([req.req_id]))
        step.swapped_out.append(req)
        req.status = RequestStatus.SWAPPED
        bisect.insort(sched.swapped, req, key=lambda r: r.arrival)
        sched.num_swap_outs += 1
    else:
        sched.block_manager.free(req.req_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        sched.waiting.appendleft(req)
    req.num_preemptions += 1
    sched.num_preemptions += 1
    step.preempted = True
    if req.req_id in sched._executor_req_ids:
        sched._executor_req_ids.discard(req.req_id)
        sched._pending_preempted_ids.append(req.req_id)


def resume_swapped(sched: Scheduler, step: _Step) -> None:
    """Swap requests back in, oldest first, while their blocks, a token and their sequence
    slots fit. The executor gets each as a NewRequest with all its tokens and its new table."""
    bm = sched.block_manager
    while sched.swapped and step.budget > 0:
        req = sched.swapped[0]
        if not sched._fits_seq_cap(req, step):
            break
        num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
        target = req.num_computed_tokens + num_new
        num_growth = max(0, bm.blocks_for(target) - len(bm.cpu_tables[req.req_id]))
        if bm.num_swap_in_blocks([req.req_id]) + num_growth > bm.num_free_blocks:
            break  # the oldest goes first; younger ones wait behind it
        sched.swapped.pop(0)
        step.swap_in.extend(bm.swap_in([req.req_id]))
        alloc = bm.allocate(req.req_id, target)
        if alloc.copy is not None:
            step.block_copies.append(alloc.copy)
        sched._start_running(req)
        step.num_seq_slots += num_seq_slots([req])
        step.new_reqs.append(sched._new_request(req, num_new))
        sched._advance(req, num_new)
        step.budget -= num_new


def undo_swap_outs(sched: Scheduler, swapped_out: list[Request]) -> None:
    """The step that swapped these requests out failed, so the CPU may hold none of their KV:
    each one still swapped starts over by recompute, at the front of `waiting`."""
    for req in swapped_out:
        if req.status is RequestStatus.SWAPPED:
            sched.swapped.remove(req)
            sched.block_manager.free(req.req_id)
            req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
            sched.waiting.appendleft(req)
