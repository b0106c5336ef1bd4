"""Sequence groups: one public request served by several scheduler requests on shared blocks.

Parallel sampling (n > 1):

    parent "<id>/prompt" computes prompt[:-1] ──fork──> "<id>/0" .. "<id>/n-1"
    (its sampled token is thrown away)                  each computes the last prompt token,
                                                        samples with its own seed, streams with
                                                        its index and finishes on its own

The children share every prompt block (ref counts); writing the last prompt token into the
partly filled last block, every child but the last one to write gets its own copy of it
(copy-on-write in `BlockManager.allocate`; none is needed if prompt[:-1] fills its blocks). After
the fork every child is an ordinary request: preemption, swap and stop rules apply unchanged.

Beam search (beam_width > 1): the beams "<id>/beam<k>" are greedy requests that return their
top logprobs and do not append what they sample (protocol v2, `append_sampled=False`). Once
every live beam has reported for the current length, `BeamSearch.step` picks the next beams;
a beam picked once continues with its token (`CachedRequest.new_token_ids`), a beam picked
several times forks (the fork shares its blocks), a beam not picked finishes. When the search
ends, the best n hypotheses go to the client, one final message per index. If any beam is
preempted, the whole search restarts from the prompt (`BeamGroup.restart`): beams share blocks
and wait for each other, so resuming them one by one could hold blocks forever; a greedy
search replays the same beams, so the answer does not change.

The group's `outputs[i]` is the Request whose stream carries index i: a child for parallel
sampling, a result holder (never scheduled) for beam search. Hidden requests (the parent, the
beams) reach no stream.

Groups only decide: the Scheduler's parts own every queue, table and status and carry out what
a group decides (`BeamDecision`: step_results.py; `restart`: `RequestQueues.restart_beam_search`).
After the loss of an executor a group is not rebuilt as it was: see `registry.py` for how each
kind resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from protos.plan import SamplingSpec
from scheduler_svc.sched.beam_search import BeamSearch, TextStop
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.sequence_params import SequenceParams, sequence_seed

# (req_id, token ids, sampling, index) -> a WAITING Request of this group
RequestFactory = Callable[[str, list[int], SamplingSpec, int], Request]


@dataclass
class BeamDecision:
    """What the scheduler does after a beam step, in this order."""

    forks: list[tuple[Request, Request]] = field(default_factory=list)  # (parent, child)
    continues: list[tuple[Request, int]] = field(default_factory=list)  # (beam, next token)
    dropped: list[Request] = field(default_factory=list)  # finish silently, free blocks
    finals: list[Request] = field(default_factory=list)  # filled result holders (search done)


class ParallelGroup:
    def __init__(self, req_id: str, params: SequenceParams, prompt_token_ids: list[int],
                 sampling: SamplingSpec, new_request: RequestFactory):
        self.req_id = req_id
        # Prompt logprobs go on index 0's stream: sequence 0 computes them, on its own
        # prompt (a forked child computes only the last prompt position).
        self.outputs = [
            new_request(f"{req_id}/{i}", list(prompt_token_ids),
                        replace(sampling, seed=sequence_seed(sampling.seed, i),
                                prompt_logprobs=sampling.prompt_logprobs if i == 0 else -1), i)
            for i in range(params.n)]
        self.parent: Request | None = None
        # A one-token prompt has nothing to share; with prompt logprobs, nothing is forked.
        if len(prompt_token_ids) > 1 and sampling.prompt_logprobs < 0:
            self.parent = new_request(f"{req_id}/prompt", list(prompt_token_ids[:-1]),
                                      SamplingSpec(temperature=0.0), 0)
        for req in self.members():
            req.group = self

    def members(self) -> list[Request]:
        return ([self.parent] if self.parent else []) + self.outputs

    def initial_requests(self) -> list[Request]:
        """What joins the waiting queue: the parent, or every child if there is none."""
        return [self.parent] if self.parent else list(self.outputs)

    def is_done(self) -> bool:
        return all(r.is_finished for r in self.outputs)


class BeamGroup:
    def __init__(self, req_id: str, params: SequenceParams, prompt_token_ids: list[int],
                 max_tokens: int, stop_token_ids: frozenset[int], vocab_size: int,
                 new_request: RequestFactory, text_stop: TextStop | None = None):
        self.req_id = req_id
        self.text_stop = text_stop  # stop strings (scheduler_svc.text.stop_strings)
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.stop_token_ids = stop_token_ids
        self._new_request = new_request
        self._vocab_size = vocab_size
        # Result holders: never scheduled, filled when the search ends.
        self.outputs = [new_request(f"{req_id}/{i}", list(prompt_token_ids),
                                    SamplingSpec(temperature=0.0), i)
                        for i in range(params.n)]
        for req in self.outputs:
            req.group = self
        self.num_restarts = 0
        self.num_cached_tokens = 0  # prompt tokens the root beam found in the prefix cache
        self._start()

    def _start(self) -> None:
        self.search = BeamSearch(self.params.beam_width, self.max_tokens, self.stop_token_ids,
                                 self.params.length_penalty, self.params.early_stopping,
                                 self.text_stop)
        self._num_beams_made = 0
        self._reported: dict[str, list[tuple[int, float]]] = {}
        self.beams: list[Request] = [self._new_beam(self.prompt_token_ids, [])]

    def _new_beam(self, prompt: list[int], output_token_ids: list[int]) -> Request:
        # Enough logprobs for every candidate the search may keep; temperature 0 so the
        # executor's own (discarded) draw consumes no randomness.
        spec = SamplingSpec(temperature=0.0, append_sampled=False,
                            num_logprobs=min(self.search.num_candidates, self._vocab_size))
        beam = self._new_request(f"{self.req_id}/beam{self.num_restarts}.{self._num_beams_made}",
                                 list(prompt), spec, 0)
        beam.output_token_ids = list(output_token_ids)
        beam.group = self
        self._num_beams_made += 1
        return beam

    def members(self) -> list[Request]:
        return self.beams + self.outputs

    def initial_requests(self) -> list[Request]:
        return list(self.beams)

    def is_done(self) -> bool:
        return all(r.is_finished for r in self.outputs)

    def restart(self) -> Request:
        """Forget every beam (the caller frees them) and start over from the prompt; returns
        the new root beam for the waiting queue."""
        self.num_restarts += 1
        self._start()
        return self.beams[0]

    def on_logprobs(self, beam: Request, pairs: list[tuple[int, float]]) -> BeamDecision | None:
        """Record beam's top logprobs; once every live beam has reported, run one step."""
        assert beam in self.beams, f"{beam.req_id} is not a live beam"
        if not beam.output_token_ids:  # the root, first report after its prompt
            self.num_cached_tokens = beam.num_cached_tokens
        self._reported[beam.req_id] = pairs
        if len(self._reported) < len(self.beams):
            return None  # the others have not been computed yet this round
        next_beams = self.search.step([self._reported[b.req_id] for b in self.beams])
        self._reported.clear()
        decision = BeamDecision()
        if self.search.done:
            decision.dropped, self.beams = self.beams, []
            decision.finals = self._fill_outputs()
            return decision
        claimed: set[int] = set()
        new_beams: list[Request] = []
        for nb in next_beams:
            parent = self.beams[nb.parent]
            if nb.parent not in claimed:
                claimed.add(nb.parent)
                decision.continues.append((parent, nb.token_id))
                new_beams.append(parent)
            else:
                child = self._new_beam(parent.prompt_token_ids,
                                       parent.output_token_ids + [nb.token_id])
                decision.forks.append((parent, child))
                new_beams.append(child)
        decision.dropped = [b for i, b in enumerate(self.beams) if i not in claimed]
        self.beams = new_beams
        return decision

    def _fill_outputs(self) -> list[Request]:
        best = self.search.best(len(self.outputs))
        for holder in self.outputs:
            holder.num_cached_tokens = self.num_cached_tokens
        for holder, hyp in zip(self.outputs, best, strict=False):
            holder.output_token_ids = list(hyp.token_ids)
            holder.status = (RequestStatus.FINISHED_STOPPED if hyp.stopped
                             else RequestStatus.FINISHED_LENGTH)
            if hyp.stopped:
                holder.matched_stop = (hyp.stop_str if hyp.stop_str is not None
                                       else hyp.token_ids[-1])
        for holder in self.outputs[len(best):]:  # only with a vocabulary smaller than 2k
            holder.status = RequestStatus.FINISHED_LENGTH
        return list(self.outputs)


SequenceGroup = ParallelGroup | BeamGroup


# ---- what the scheduler asks of groups ----------------------------------------------------

def num_seq_slots(reqs: Iterable[Request]) -> int:
    """How many of `max_num_seqs` these requests hold: a group counts what it grows to, so
    that forks cannot push the running sequences past the cap. A parallel-sampling parent
    stands for its n children, a beam search for beam_width beams (however many are live)."""
    num_slots, searches = 0, set()
    for req in reqs:
        group = req.group
        if isinstance(group, BeamGroup):
            if id(group) not in searches:
                searches.add(id(group))
                num_slots += group.params.beam_width
        elif isinstance(group, ParallelGroup) and req is group.parent:
            num_slots += len(group.outputs)
        else:
            num_slots += 1
    return num_slots
