"""Continuous batching: which tokens of which requests the executor computes next.

Every request carries `num_computed_tokens`; a step gives each scheduled request
min(tokens it still lacks, token budget left), so prefill chunks and decodes share a step and a
long prompt spreads over several steps. `max_num_batched_tokens` bounds every step. Order:

1. running requests that decode (one token each), oldest first: streams never stall;
2. running requests mid-prompt, oldest first, with what budget is left;
3. (blocks) while the blocks those need exceed the free ones, preempt the newest running
   request, by swap or recompute (`preemption.py` decides which); the oldest is never
   preempted while another runs, so it always finishes, and a request fits the pool alone;
   if the victims held the whole budget, 1-3 run again for the requests still running;
4. swapped-out requests, oldest first, swapped back in (not in a step that preempted);
5. waiting requests, FCFS (not after a preemption, nor while any request is swapped out),
   each reusing every cached block of its leading tokens (prefix caching, `prefix_cache.py`).

The Scheduler plans; its parts own the state, each whole in one place:

    Scheduler (this module: builds each StepPlan; its config: budget, caps, policies)
     |- block_manager   BlockManager    every block table, ref count, the prefix cache
     |- queues          RequestQueues   which request is waiting, running or swapped, the
     |                                  sequence groups, every move between queues (queues.py)
     |- executor_view   ExecutorView    what the executor holds and must be told, the plans
     |                                  in flight (executor_view.py)
     |- results         ResultApplier   applies each result: tokens, stops, beams, speculation
     |                                  (step_results.py)
     '- counters        SchedulerCounters  what it has done, for ServerStats (counters.py)

`preemption.py` and the sequence groups only return decisions, which the planner and the
result applier carry out through the queues. A Scheduler serves one executor connection; what
outlives the connection (every client's request and the tokens streamed so far) is in
`registry.py`.

Overlap. The engine plans step N+1 while the executor runs step N: `schedule()` may be called
with one plan in flight (never two). A request that samples in a step in flight holds a
*placeholder* per such step (`Request.num_placeholders`): its token is not known yet, but the
executor appends it to its own copy, so the next plan schedules the request's next position as
if the token were there. `update()` turns the oldest placeholder into the real token; a token
computed past a stop is discarded (the request is gone by then: finished in `update()` for a
stop id, by `stop_request()` right after it for a stop string). With a plan in flight,
`schedule()` returns None instead of a plan, and the engine falls back to lockstep (waits for
the result, then schedules), when the plan would
- preempt (blocks run short): victims are only chosen with nothing in flight, so a preempted
  request never has a token in flight, and swap/recompute see settled state;
- serve a beam search: beams choose their next tokens from each step's logprobs;
and it swaps nothing in right after a plan that swapped out. Decodes never go past max_tokens
or max_model_len counting placeholders. Requests sent as NewRequest (admitted, resumed, forked)
have no placeholder. The executor runs plans in order, so a block freed (or offered to the
prefix cache) while a step is in flight is only reused by a later step.

Invariants between plans (at most two plans are in flight): each part's docstring states
those of the state it owns (queues, tables, what the executor holds). Across them:
- a running request's GPU table covers its computed tokens;
- a request the executor holds whose table changed under copy-on-write is re-sent as a
  NewRequest (the executor replaces its copy), because CachedRequest can only append blocks.
  So is a running request the executor does not hold yet: a sequence forked from another.
- sequence groups (n > 1, beam search; `sequence_group.py`) run as ordinary requests, except
  that a beam waiting for its siblings' logprobs lacks no token (it is skipped), and that
  preempting a beam restarts its whole search.
- admissions (4-5) keep the running requests within `max_num_seqs` sequence slots, a group
  counting what it forks into (`num_seq_slots`: n for a parallel-sampling parent, beam_width
  for a beam search), so forks never push the running sequences past the cap. The one
  exception: a request wider than the cap is admitted when nothing else runs (it runs alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from protos.plan import CachedRequest, NewRequest, StepPlan, StepResult
from scheduler_svc.config import PREEMPTION_MODES
from scheduler_svc.sched.block_manager import BlockManager
from scheduler_svc.sched.counters import SchedulerCounters
from scheduler_svc.sched.executor_view import ExecutorView
from scheduler_svc.sched.preemption import preemption_mode, swap_in_fits
from scheduler_svc.sched.prefix_cache import cached_prefix
from scheduler_svc.sched.queues import RequestQueues
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.sequence_group import BeamGroup, SequenceGroup, num_seq_slots
from scheduler_svc.sched.speculation import proposal, speculates
from scheduler_svc.sched.step_results import ResultApplier, StepOutput

log = structlog.get_logger("folio.scheduler.scheduler")

MAX_IN_FLIGHT = 2  # the plan the executor runs and the one planned meanwhile


@dataclass
class _Step:
    """The plan being built by one schedule() call."""

    budget: int
    new_reqs: list[NewRequest] = field(default_factory=list)
    cached_reqs: list[CachedRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swapped_out: list[Request] = field(default_factory=list)  # victims of this step's swap_out
    preempted: bool = False
    drafts: dict[str, list[int]] = field(default_factory=dict)  # speculation.py's proposals
    lookahead: dict[str, int] = field(default_factory=dict)  # draft model's KV slots, by req
    num_seq_slots: int = 0  # of max_num_seqs, held by the running requests (num_seq_slots)


class Scheduler:
    """Plans one step at a time over the parts it owns (see the module docstring), and applies
    each result through `results`. Its methods are what the engine's loop does with it: add,
    abort, fail and stop requests; schedule, update and abandon plans. What it holds is read
    from its parts (`queues.waiting`, `counters.num_steps`, `block_manager`...)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, *,
                 enable_prefix_caching: bool = True, preemption_mode: str = "auto",
                 first_step_id: int = 0, reset_executor: bool = False,
                 num_speculative_tokens: int = 0, speculative_method: str = "ngram"):
        assert preemption_mode in PREEMPTION_MODES, preemption_mode
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_prefix_caching = enable_prefix_caching
        self.preemption_mode = preemption_mode
        self.num_speculative_tokens = num_speculative_tokens  # 0: no speculative decoding
        self.speculative_method = speculative_method  # ngram | draft (speculation.py)
        self.block_manager = block_manager
        self.counters = SchedulerCounters()
        self.executor_view = ExecutorView(first_step_id, reset_executor)
        self.queues = RequestQueues(block_manager, self.executor_view, self.counters)
        self.results = ResultApplier(self.queues, block_manager, self.counters, max_model_len,
                                     enable_prefix_caching=enable_prefix_caching,
                                     num_speculative_tokens=num_speculative_tokens)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing can be scheduled now (with a plan in
        flight: also when this step must wait for its result, see "Overlap")."""
        queues, executor_view = self.queues, self.executor_view
        assert executor_view.num_in_flight < MAX_IN_FLIGHT, "schedule() with two plans in flight"
        overlapping = bool(executor_view.num_in_flight)
        if overlapping and (self.num_speculative_tokens or queues.has_beam_search()):
            return None
        step = _Step(budget=self.max_num_batched_tokens)
        if self.block_manager.windowed:  # before counting what the running requests need
            self._release_outside_windows()
        # 1-2. Running requests get their tokens: decodes first, then prompt chunks.
        wants = self._budget_running(step)
        num_needed = self._num_blocks_needed(wants, step.lookahead)
        if overlapping and num_needed > self.block_manager.num_free_blocks:
            return None  # someone must be preempted: only with nothing in flight
        # 3. Blocks for them, preempting the newest running requests if need be.
        wants = self._make_room(wants, num_needed, step)
        while step.preempted and not wants and queues.running:
            # The victims held the whole budget (decodes take it first, and the newest request
            # may decode while an older one is mid-prompt): hand it out again, or the step
            # would be empty and the engine would idle with requests it could run.
            step.budget, step.drafts, step.lookahead = self.max_num_batched_tokens, {}, {}
            wants = self._budget_running(step)
            if not wants:
                break  # nothing running lacks a token now (beams waiting for their siblings)
            wants = self._make_room(wants, self._num_blocks_needed(wants, step.lookahead), step)
        self._schedule_running(wants, step)
        # 4-5. Only if nobody had to make room: swapped requests, then waiting ones.
        step.num_seq_slots = num_seq_slots(queues.running)
        if not step.preempted and not (overlapping and executor_view.newest_plan().swap_out):
            self._resume_swapped(step)
        if not step.preempted and not queues.swapped:
            self._admit_waiting(step)
        if not (step.new_reqs or step.cached_reqs or step.swap_out or step.block_copies):
            # Nothing to run; pending finished/preempted ids and host-tier copies ride the
            # next plan (no copy-in is pending: only an admission makes one).
            return None
        offload_out, offload_in = self.block_manager.take_tier_copies()
        host_key = self.block_manager.host_key
        return executor_view.make_plan(new_reqs=step.new_reqs, cached_reqs=step.cached_reqs,
                                       block_copies=step.block_copies, swap_out=step.swap_out,
                                       swap_in=step.swap_in, swapped_out=step.swapped_out,
                                       offload_out=offload_out, offload_in=offload_in,
                                       offload_keys=[host_key(s).hex() for _, s in offload_out])

    # ---- results, and plans that fail ------------------------------------------------------

    def update(self, result: StepResult) -> list[StepOutput]:
        """Apply the oldest in-flight plan's sampled tokens; finish requests that hit a stop
        (step_results.py)."""
        return self.results.apply(self.executor_view.complete(result.step_id), result)

    def abandon_oldest(self) -> list[str]:
        """The oldest in-flight step failed: forget it and return the ids it scheduled (the
        caller fails them). A plan still in flight behind it stays: the executor skips the
        failed requests in it (executor_svc/worker.py)."""
        failed = self.executor_view.abandon_oldest()
        if failed is None:
            return []
        # Requests it swapped out may have no KV on the CPU: they start over by recompute.
        for req in failed.swapped_out:
            self.queues.requeue_swapped(req)
        plan = failed.plan
        # Its copies into the host tier may not have run: those slots promise nothing.
        self.block_manager.forget_host_blocks(slot for _, slot in plan.offload_out)
        return [r.req_id for r in plan.new_reqs] + [r.req_id for r in plan.cached_reqs]

    def abandon_in_flight(self) -> list[str]:
        """Forget every plan in flight; returns the ids they scheduled."""
        req_ids: list[str] = []
        while self.executor_view.num_in_flight:
            req_ids += self.abandon_oldest()
        return list(dict.fromkeys(req_ids))

    # ---- requests in and out (queues.py) ---------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.queues.add_request(req)

    def add_group(self, group: SequenceGroup) -> None:
        self.queues.add_group(group)

    def abort_request(self, req_id: str) -> Request | None:
        return self.queues.abort_request(req_id)

    def abort_group(self, req_id: str) -> list[Request]:
        return self.queues.abort_group(req_id)

    def fail_requests(self, req_ids: list[str]) -> list[Request]:
        return self.queues.fail_requests(req_ids)

    def stop_request(self, req_id: str) -> None:
        """Finish a sequence whose text completed a stop string (found after `update`, by the
        output processor). A token a step in flight computes for it is discarded by `update`,
        and its id rides the next plan's finished_req_ids. No-op if it already finished."""
        self.queues.stop_request(req_id)

    def has_unfinished(self) -> bool:
        return self.queues.has_unfinished()

    # ---- plans in flight (executor_view.py) ------------------------------------------------

    @property
    def next_step_id(self) -> int:
        return self.executor_view.next_step_id

    @property
    def num_in_flight(self) -> int:
        return self.executor_view.num_in_flight

    def oldest_in_flight(self) -> StepPlan | None:
        """The plan whose result comes next (the executor runs plans in order)."""
        return self.executor_view.oldest_plan()

    # ---- the phases of schedule() ----------------------------------------------------------

    def _budget_running(self, step: _Step) -> list[tuple[Request, int]]:
        """Token budget for running requests: decodes first, then prompt chunks."""
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        for req in self.queues.running:  # one pass: it runs every step over every running one
            num_placeholders = req.num_placeholders
            num_lacking = req.num_tokens + num_placeholders - req.num_computed_tokens
            if num_placeholders and (
                    len(req.output_token_ids) + num_placeholders >= req.max_tokens
                    or req.num_tokens + num_placeholders >= self.max_model_len):
                continue  # the token in flight is its last: nothing to compute after it
            if num_lacking == 1:
                decodes.append((req, 1))
            elif num_lacking > 1:
                prefills.append((req, num_lacking))
        wants: list[tuple[Request, int]] = []
        k = self.num_speculative_tokens
        for i, (req, num_lacking) in enumerate(decodes + prefills):
            if step.budget == 0:
                break
            num_new = min(num_lacking, step.budget)
            if k and i < len(decodes):
                drafts = proposal(req, k, self.max_model_len, step.budget,
                                  self.speculative_method)
                if drafts:
                    step.drafts[req.req_id] = drafts
                    num_new += len(drafts)
                if self.speculative_method == "draft" and speculates(req):
                    step.lookahead[req.req_id] = k
            wants.append((req, num_new))
            step.budget -= num_new
        return wants

    def _make_room(self, wants: list[tuple[Request, int]], num_needed: int, step: _Step
                   ) -> list[tuple[Request, int]]:
        """Preempt the newest running requests until the blocks `wants` need (`num_needed`
        now) are free; returns the wants of the requests still running."""
        bm = self.block_manager
        while num_needed > bm.num_free_blocks:
            if step.lookahead:  # the draft model's slots are the first to go
                step.lookahead.clear()
                num_needed = self._num_blocks_needed(wants, step.lookahead)
                continue
            self._preempt(self.queues.running[-1], step)  # non-empty: wants holds running ones
            # Not just the victim: preempting a beam ends all beams of its search.
            wants = [(r, n) for r, n in wants if r.status is RequestStatus.RUNNING]
            num_needed = self._num_blocks_needed(wants, step.lookahead)
        return wants

    def _preempt(self, req: Request, step: _Step) -> None:
        self.counters.num_preemptions += 1
        step.preempted = True
        if isinstance(req.group, BeamGroup):
            # Beams share blocks and wait for each other every step: resumed one by one they
            # could hold blocks forever. The search restarts instead; greedy, it replays.
            log.info("beam search preempted: restarting it", req_id=req.group.req_id,
                     num_beams=len(req.group.beams))
            self.queues.restart_beam_search(req.group)
            return
        mode = preemption_mode(self.preemption_mode, self.block_manager, req)
        log.info("request preempted", req_id=req.req_id, mode=mode,
                 num_computed_tokens=req.num_computed_tokens)
        step.swap_out.extend(self.queues.preempt(req, mode))
        if mode == "swap":
            step.swapped_out.append(req)
            self.counters.num_swap_outs += 1

    def _resume_swapped(self, step: _Step) -> None:
        """Swap requests back in, oldest first, while their blocks, a token and their sequence
        slots fit. The executor gets each as a NewRequest with all its tokens and new table."""
        bm, swapped = self.block_manager, self.queues.swapped
        while swapped and step.budget > 0:
            req = swapped[0]
            if not self._fits_seq_cap(req, step):
                break
            num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
            if not swap_in_fits(bm, req, num_new):
                break  # the oldest goes first; younger ones wait behind it
            step.swap_in.extend(self.queues.swap_in(req))
            alloc = bm.allocate(req.req_id, req.num_computed_tokens + num_new)
            step.block_copies.extend(alloc.copies)
            step.num_seq_slots += num_seq_slots([req])
            step.new_reqs.append(self._new_request(req, num_new))
            self._advance(req, num_new)
            step.budget -= num_new

    def _schedule_running(self, wants: list[tuple[Request, int]], step: _Step) -> None:
        """Blocks for each running request's tokens (there are enough: `_make_room`), and its
        plan entry (a loop over every running request at every step)."""
        allocate, held = self.block_manager.allocate, self.executor_view.held_req_ids
        cached_reqs = step.cached_reqs
        lookahead, max_len = step.lookahead, self.max_model_len
        for req, num_new in wants:
            num_computed = req.num_computed_tokens
            alloc = allocate(req.req_id, min(num_computed + num_new + lookahead.get(req.req_id, 0),
                                             max_len))
            assert alloc is not None, "make_room left too few blocks"
            if alloc.copies:
                step.block_copies.extend(alloc.copies)
            drafts = step.drafts.get(req.req_id, [])
            if not alloc.copies and req.req_id in held:
                cached_reqs.append(CachedRequest(req_id=req.req_id,
                                                 new_block_ids=alloc.new_block_ids,
                                                 num_computed_tokens=num_computed,
                                                 num_scheduled_tokens=num_new,
                                                 new_token_ids=req.pending_token_ids,
                                                 spec_token_ids=drafts))
                req.pending_token_ids = []
                req.spec_token_ids = drafts  # (their blocks stay allocated as lookahead)
            else:  # forked, or copy-on-write replaced a block the executor has: the whole table
                num_new -= len(drafts)  # a NewRequest proposes nothing
                step.new_reqs.append(self._new_request(req, num_new))
            self._advance(req, num_new)  # budget: taken in _budget_running

    def _release_outside_windows(self) -> None:
        """Every running request's next queries start at its computed count: the windowed
        groups' blocks below their windows go back to the pool (with prefix caching, once
        offered to the cache, so they stay hits until evicted)."""
        release, caching = self.block_manager.release_outside_windows, self.enable_prefix_caching
        released = 0
        for req in self.queues.running:
            released += release(req.req_id, req.num_computed_tokens, caching)
        self.counters.num_window_released_blocks += released

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting requests FCFS while budget, sequence slots and blocks last."""
        bm, waiting = self.block_manager, self.queues.waiting
        while waiting and step.budget > 0:
            req = waiting[0]
            if not self._fits_seq_cap(req, step):
                break  # FCFS: a group waits for its sequence slots, no one overtakes it
            # Prompt logprobs need every prompt position computed: no prefix cache read then.
            cached_block_ids = (cached_prefix(bm, req) if self.enable_prefix_caching
                                and req.sampling.prompt_logprobs < 0 else [])
            num_cached = len(cached_block_ids) // bm.num_groups * bm.block_size
            num_new = min(req.num_tokens - num_cached, step.budget)
            if not self.queues.admit(req, num_cached + num_new, cached_block_ids):
                break  # head-of-line waits for blocks; FCFS lets no one overtake it
            if self.enable_prefix_caching:
                self.counters.prefix_cache_queries += req.num_tokens
                self.counters.prefix_cache_hits += num_cached
                self.counters.prefix_cache_host_hits += \
                    bm.num_host_hit_positions(cached_block_ids) * bm.block_size
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            step.num_seq_slots += num_seq_slots([req])
            step.new_reqs.append(self._new_request(req, num_new))
            self._advance(req, num_new)
            step.budget -= num_new

    # ---- helpers ---------------------------------------------------------------------------

    def _num_blocks_needed(self, wants: list[tuple[Request, int]],
                           lookahead: dict[str, int]) -> int:
        return self.block_manager.num_blocks_needed_many(
            [r.req_id for r, _ in wants],
            [min(r.num_computed_tokens + n + lookahead.get(r.req_id, 0), self.max_model_len)
             for r, n in wants])

    def _new_request(self, req: Request, num_new: int) -> NewRequest:
        # The executor's copy is replaced by the known tokens: nothing may be in flight for it.
        assert req.num_placeholders == 0, f"{req.req_id} re-sent with a token in flight"
        self.executor_view.mark_sent(req.req_id)
        req.pending_token_ids = []  # all_token_ids carries them
        req.executor_prompt_logprobs = req.sampling.prompt_logprobs >= 0
        return NewRequest(req_id=req.req_id, token_ids=req.all_token_ids, sampling=req.sampling,
                          block_ids=self.block_manager.plan_table(req.req_id),
                          num_computed_tokens=req.num_computed_tokens,
                          num_scheduled_tokens=num_new, num_prompt_tokens=req.num_prompt_tokens)

    def _fits_seq_cap(self, req: Request, step: _Step) -> bool:
        """Room under `max_num_seqs` for `req` and the sequences it forks into. With nothing
        running anything fits, so a group wider than the cap still runs (alone)."""
        return not self.queues.running or \
            step.num_seq_slots + num_seq_slots([req]) <= self.max_num_seqs

    def _advance(self, req: Request, num_new: int) -> None:
        # Tokens count as computed once scheduled: the executor runs plans in order, and a
        # failed step fails its requests, so the count never has to roll back.
        assert num_new >= 1
        if req.num_computed_tokens < len(req.prompt_token_ids):  # a prompt chunk
            prompt_end = min(req.num_computed_tokens + num_new, len(req.prompt_token_ids))
            self.counters.num_prompt_tokens += prompt_end - req.num_computed_tokens
        req.num_computed_tokens += num_new
        if (req.num_computed_tokens - len(req.spec_token_ids)
                == req.num_tokens + req.num_placeholders
                and req.sampling.append_sampled
                and (req.group is None or req in req.group.outputs)):
            req.num_placeholders += 1  # it samples this step; the executor appends the token
