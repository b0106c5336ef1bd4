"""Property-based tests (hypothesis) of the block manager and the scheduler.

1. A state machine drives the BlockManager with random new / grow / fork / free / swap-out /
   swap-in operations over a tiny alphabet (so prompts share prefixes and hit the cache) and
   simulates the KV slots: every sequence must read back exactly its own tokens, no write may
   land in a shared or cached block, and the pool invariants hold after every operation. With a
   host tier, each operation is a plan: its tier copies run in the executor's order (copy-outs
   first, copy-ins after the swaps), and every keyed host slot must hold what its key says.
2. Random workloads drive the Scheduler (add / step with synthetic results, EOS sometimes /
   abort) on pools small enough to force preemption, with every preemption mode and prefix
   caching on or off: every plan passes the KV-simulating PlanMirror, the invariants hold,
   every request finishes within a bounded number of steps with the same tokens as an
   uninterrupted run, and when all have ended no block is held or leaked. The same workloads
   run overlapped too (a plan scheduled while the previous one's result is outstanding, as
   the engine does), against the same oracle.
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from protos.plan import SamplingSpec
from scheduler_svc.sched.block_manager import FREED, BlockManager
from scheduler_svc.sched.prefix_cache import extend_block_keys
from scheduler_svc.sched.request import Request, RequestStatus
from scheduler_svc.sched.scheduler import Scheduler
from tests.scheduler.null_executor import PlanMirror, next_token

BS = 2
EOS = 1


class BlockManagerMachine(RuleBasedStateMachine):
    """`WINDOWS`: the KV groups (0 = full attention); every token is written in each group's
    block, and a windowed group must read back only what its window needs."""

    WINDOWS: tuple[int, ...] = (0,)
    NUM_HOST_BLOCKS = 0  # per group: the host tier of the prefix cache

    def __init__(self):
        super().__init__()
        self.G = len(self.WINDOWS)
        self.bm = BlockManager(num_blocks=12 * self.G, block_size=BS,
                               num_cpu_blocks=6 * self.G, windows=self.WINDOWS,
                               num_host_blocks=self.NUM_HOST_BLOCKS * self.G)
        self.tokens: dict[str, list[int]] = {}  # every live sequence's tokens (all written)
        self.first_query: dict[str, int] = {}  # where each sequence's next queries may start
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.contents: dict[bytes, list] = {}  # what each block key says a block holds
        self.next_id = 0

    def _run_tier_copies(self) -> None:
        """The executor's part of a plan's tier copies: copy-outs, then copy-ins."""
        offload_out, offload_in = self.bm.take_tier_copies()
        for block_id, slot in offload_out:
            self.host[slot] = list(self.gpu[block_id])
        for slot, block_id in offload_in:
            self.gpu[block_id] = list(self.host[slot])

    def _on_gpu(self) -> list[str]:
        return sorted(self.bm.block_tables)

    def _needed(self, seq_id: str, group: int) -> range:
        """The positions of `seq_id` that group `group` must still hold."""
        w = self.WINDOWS[group]
        first = max(0, self.first_query[seq_id] - w + 1) if w else 0
        return range(first, len(self.tokens[seq_id]))

    def _write(self, seq_id: str, start: int) -> None:
        table, tokens, G = self.bm.block_tables[seq_id], self.tokens[seq_id], self.G
        for p in range(start, len(tokens)):
            for g in range(G):
                block_id = table[p // BS * G + g]
                assert block_id != FREED, "a write into a released position"
                assert self.bm.ref_counts[block_id] == 1, "a write into a shared block"
                assert block_id not in self.bm._key_of, "a write into a cached block"
                self.gpu.setdefault(block_id, [None] * BS)[p % BS] = (tokens[p], p)
        keys = extend_block_keys([], tokens, BS)
        for k, key in enumerate(keys):
            for g in range(G):
                self.contents[self.bm._group_key(key, g)] = [
                    (tokens[p], p) for p in range(k * BS, (k + 1) * BS)]
        self.bm.cache_blocks(seq_id, keys)  # all written tokens count as computed

    @rule(tokens=st.lists(st.integers(2, 3), min_size=1, max_size=9))
    def new(self, tokens):
        seq_id = f"s{self.next_id}"
        self.next_id += 1
        keys = extend_block_keys([], tokens, BS)
        hits = self.bm.cached_prefix(keys[:(len(tokens) - 1) // BS])
        if self.bm.allocate_new(seq_id, len(tokens), hits) is None:
            return
        if self.bm.num_host_hit_positions(hits):
            event("a prefix hit in the host tier")  # hypothesis' statistics show the share
        self._run_tier_copies()
        self.tokens[seq_id] = list(tokens)
        num_cached = len(hits) // self.G * BS
        self.first_query[seq_id] = num_cached
        self._write(seq_id, num_cached)

    @precondition(lambda self: self.bm.block_tables)
    @rule(data=st.data(), extra=st.lists(st.integers(2, 3), min_size=1, max_size=4))
    def grow(self, data, extra):
        seq_id = data.draw(st.sampled_from(self._on_gpu()))
        start = len(self.tokens[seq_id])
        alloc = self.bm.allocate(seq_id, start + len(extra))
        self._run_tier_copies()
        if alloc is None:
            return
        for src, dst in alloc.copies:
            self.gpu[dst] = list(self.gpu[src])
        self.tokens[seq_id] += extra
        self._write(seq_id, start)

    @precondition(lambda self: self.bm.block_tables)
    @rule(data=st.data())
    def release_outside_windows(self, data):
        # The next queries start after every written token: what lies below their windows goes.
        seq_id = data.draw(st.sampled_from(self._on_gpu()))
        self.first_query[seq_id] = len(self.tokens[seq_id])
        self.bm.release_outside_windows(seq_id, self.first_query[seq_id])

    @precondition(lambda self: self.bm.block_tables)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._on_gpu()))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.first_query[child] = self.first_query[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id]

    @precondition(lambda self: self.bm.block_tables)
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self._on_gpu()))
        self._run_tier_copies()  # a plan's copy-outs come before its swaps
        for gpu_id, cpu_id in self.bm.swap_out([seq_id]) or []:
            self.cpu[cpu_id] = list(self.gpu[gpu_id])

    @precondition(lambda self: self.bm.cpu_tables)
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.bm.cpu_tables)))
        self._run_tier_copies()
        for cpu_id, gpu_id in self.bm.swap_in([seq_id]) or []:
            self.gpu[gpu_id] = list(self.cpu[cpu_id])

    @invariant()
    def pools_are_consistent_and_every_sequence_reads_its_own_tokens(self):
        self.bm.check_invariants()
        for seq_id, tokens in self.tokens.items():
            on_gpu = seq_id in self.bm.block_tables
            table = self.bm.block_tables[seq_id] if on_gpu else self.bm.cpu_tables[seq_id]
            slots = self.gpu if on_gpu else self.cpu
            for g in range(self.G):
                needed = self._needed(seq_id, g)
                assert [slots[table[p // BS * self.G + g]][p % BS] for p in needed] == \
                    [(tokens[p], p) for p in needed], (seq_id, g)
        pending = {slot for _, slot in self.bm._offload_out}  # written by the next plan
        for slot, key in self.bm._host_key_of.items():
            if slot not in pending:
                assert self.host[slot] == self.contents[key], f"host slot {slot} is stale"

    def teardown(self):
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        self._run_tier_copies()
        assert self.bm.num_free_blocks == 12 * self.G
        assert self.bm.num_free_cpu_blocks == 6 * self.G
        assert self.bm.ref_counts == [0] * (12 * self.G)
        self.bm.check_invariants()


class WindowedBlockManagerMachine(BlockManagerMachine):
    WINDOWS = (0, 3, 5)  # a full-attention group and two windows (Gemma-like, smaller)


class SlidingBlockManagerMachine(BlockManagerMachine):
    WINDOWS = (3,)  # every layer windowed (Mistral-like)


class HostTierBlockManagerMachine(BlockManagerMachine):
    NUM_HOST_BLOCKS = 20  # more than the device pool: evicted blocks keep being hits


class WindowedHostTierBlockManagerMachine(BlockManagerMachine):
    WINDOWS = (0, 3)
    NUM_HOST_BLOCKS = 5  # smaller than the device pool: the tier's own LRU evicts


MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = MACHINE_SETTINGS
TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManagerMachine.settings = MACHINE_SETTINGS
TestSlidingBlockManagerMachine = SlidingBlockManagerMachine.TestCase
TestSlidingBlockManagerMachine.settings = MACHINE_SETTINGS
TestHostTierBlockManagerMachine = HostTierBlockManagerMachine.TestCase
TestHostTierBlockManagerMachine.settings = MACHINE_SETTINGS
TestWindowedHostTierBlockManagerMachine = WindowedHostTierBlockManagerMachine.TestCase
TestWindowedHostTierBlockManagerMachine.settings = MACHINE_SETTINGS


def null_sample(req_id: str, ids: list[int]) -> int:
    """The null model, with an EOS now and then (a pure function of the tokens)."""
    return EOS if (sum(ids) * 31 + len(ids)) % 11 == 0 else next_token(ids)


def oracle(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    ids: list[int] = list(prompt)
    while True:
        token = null_sample("", ids)
        ids.append(token)
        if token == EOS or len(ids) - len(prompt) >= max_tokens or len(ids) >= max_model_len:
            return ids[len(prompt):]


PREFIXES = [[40 + i for i in range(9)], [90 + i % 3 for i in range(6)], []]

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 24), st.integers(4, 16)),
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 24), st.integers(4, 16)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=8, max_size=50), num_blocks=st.integers(3, 10),
       bs=st.sampled_from([2, 4]),
       num_cpu_blocks=st.integers(0, 8), mode=st.sampled_from(["auto", "recompute", "swap"]),
       caching=st.booleans(), max_num_seqs=st.integers(2, 4), extra_budget=st.integers(0, 12),
       overlap=st.booleans(), windows=st.sampled_from([(0,), (3,), (0, 2), (5, 0, 1)]),
       num_host_blocks=st.sampled_from([0, 0, 2, 6, 30]))
def test_random_workloads_finish_exactly_and_leak_nothing(ops, num_blocks, bs, num_cpu_blocks,
                                                          mode, caching, max_num_seqs,
                                                          extra_budget, overlap, windows,
                                                          num_host_blocks):
    max_model_len = num_blocks * bs  # every request fits the pool alone
    G = len(windows)  # KV groups: a block of each per position
    num_blocks, num_cpu_blocks = num_blocks * G, num_cpu_blocks * G
    bm = BlockManager(num_blocks, bs, num_cpu_blocks, windows=windows,
                      num_host_blocks=num_host_blocks * G)
    sched = Scheduler(bm, max_num_seqs,
                      max_num_seqs + extra_budget, max_model_len,
                      enable_prefix_caching=caching, preemption_mode=mode)
    mirror = PlanMirror(block_size=bs, sample=null_sample, windows=windows)
    reqs: list[Request] = []
    aborted: set[str] = set()

    depth = 2 if overlap else 1
    in_flight: deque = deque()  # results the executor produced, not yet applied

    def one_step() -> None:
        plan = sched.schedule() if sched.has_unfinished() and len(in_flight) < depth else None
        if plan is None:
            assert in_flight, "unfinished requests but nothing schedulable"
        else:
            assert plan.num_scheduled_tokens <= sched.max_num_batched_tokens
            in_flight.append(mirror.apply(plan))  # the executor runs plans in order
        if plan is None or len(in_flight) == depth:
            sched.update(in_flight.popleft())
        sched.block_manager.check_invariants()

    for o in ops:
        if o[0] == "add":
            _, prefix, suffix_len, max_tokens = o
            prompt = (PREFIXES[prefix] + [60 + (len(reqs) * 7 + i) % 30
                                          for i in range(suffix_len)])[:max_model_len - 1]
            req = Request(req_id=f"r{len(reqs)}", prompt_token_ids=prompt,
                          sampling=SamplingSpec(temperature=0.0), arrival=len(reqs),
                          max_tokens=min(max_tokens, max_model_len - len(prompt)),
                          eos_token_ids=frozenset({EOS}))
            reqs.append(req)
            sched.add_request(req)
        elif o[0] == "step" and (sched.has_unfinished() or in_flight):
            one_step()
        elif o[0] == "abort" and reqs:
            req = reqs[o[1] % len(reqs)]
            if sched.abort_request(req.req_id) is not None:
                aborted.add(req.req_id)
    bound = 10 * sum(r.num_prompt_tokens + r.max_tokens for r in reqs) + 10
    num_steps = 0
    while sched.has_unfinished() or in_flight:
        assert num_steps < bound, "a request waits forever"
        one_step()
        num_steps += 1
    for req in reqs:
        if req.req_id in aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
        else:
            assert req.output_token_ids == oracle(req.prompt_token_ids, req.max_tokens,
                                                  max_model_len), req.req_id
    bm = sched.block_manager
    assert not bm.block_tables and not bm.cpu_tables
    assert bm.num_free_blocks == num_blocks and bm.num_free_cpu_blocks == num_cpu_blocks
    assert bm.ref_counts == [0] * num_blocks and bm.cpu_ref_counts == [0] * num_cpu_blocks
    assert not sched.queues.running and not sched.queues.swapped and not sched.queues.waiting
    if mirror.num_offloaded_in:
        event("blocks copied back from the host tier")  # hypothesis' statistics show the share
    assert sched.counters.prefix_cache_host_hits <= sched.counters.prefix_cache_hits
