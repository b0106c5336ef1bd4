"""Preemption policy: which way a victim leaves the KV pool, and what a swap-in needs.

Pure functions of the block manager's state; the Scheduler's planner applies what they decide
(`Scheduler._make_room`, `_preempt`, `_resume_swapped`) and moves the requests through
`RequestQueues.preempt` and `swap_in` (queues.py). The newest running request goes first;
the oldest is never preempted while another runs, and any request fits the pool alone
(`max_model_len` is capped to it), so the oldest always finishes and every request eventually
does. A step that preempted admits no one. A victim is

    swapped out   GPU table --swap_out pairs--> CPU table; the request joins `swapped` (sorted
                  by arrival) with its computed tokens intact and is swapped back in before any
                  waiting request is admitted;
    recomputed    its blocks are freed; it goes back to the front of `waiting` with
                  num_computed_tokens = 0 and is re-admitted with prompt + generated tokens as
                  its prompt (reusing what the prefix cache still holds);
    a beam        its whole search restarts from the prompt (`BeamGroup.restart`).

A victim the executor holds rides the next plan's `preempted_req_ids`. Swap-out and swap-in
never share a step: a step that preempted resumes no one.
"""

from __future__ import annotations

from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.request import Request


def preemption_mode(policy: str, bm: BlockManager, req: Request) -> str:
    """"swap" or "recompute" for this victim under `policy` (--preemption-mode).

    Recompute costs ~num_computed_tokens x the model's FLOPs per token (plus attention,
    quadratic in length); a swap moves num_blocks x bytes per block over PCIe twice (out and
    back in), and per token that is several times cheaper than recomputing on any model worth
    serving. So `auto` swaps whenever the CPU pool has room and the victim has at least one
    full block of computed KV; a shorter context is cheap to recompute and not worth a round
    trip or CPU space. `swap` swaps whenever the pool has room; `recompute` never swaps.
    Without room in the CPU pool, recompute."""
    if policy == "recompute" or bm.num_cpu_blocks == 0:
        return "recompute"
    if bm.num_swap_out_blocks([req.req_id]) > bm.num_free_cpu_blocks:
        return "recompute"
    if policy == "swap" or req.num_computed_tokens >= bm.block_size:
        return "swap"
    return "recompute"


def swap_in_fits(bm: BlockManager, req: Request, num_new: int) -> bool:
    """Whether `req` can come back from the CPU pool and grow by `num_new` tokens now."""
    target = req.num_computed_tokens + num_new
    num_growth = bm.num_groups * max(0, bm.blocks_for(target)
                                     - len(bm.cpu_tables[req.req_id]) // bm.num_groups)
    return bm.num_swap_in_blocks([req.req_id]) + num_growth <= bm.num_free_blocks
