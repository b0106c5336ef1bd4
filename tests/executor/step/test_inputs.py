"""The persistent batch, after any sequence of plan diffs, gives the step inputs a from-scratch
build gives: a token-by-token reference over plain Python lists, written the slow, obvious way."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.sample.sampler import seed_bits
from executor_svc.step.input_batch import InputBatch
from executor_svc.step.inputs import build_step_inputs
from protos.plan import SamplingSpec

CPU = torch.device("cpu")
MAX_MODEL_LEN = 40


@dataclass
class _Req:
    """The oracle's copy of a request: lists, as the runner used to hold them."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    sampling: SamplingSpec = field(default_factory=SamplingSpec)


def _reference(reqs: dict[str, _Req], schedule: list[tuple[str, int]], block_size: int):
    ids, pos, slots, logits_idx, seq_lens, starts, samplers = [], [], [], [], [], [0], []
    for req_id, num_scheduled in schedule:
        req = reqs[req_id]
        for p in range(req.num_computed, req.num_computed + num_scheduled):
            ids.append(req.token_ids[p])
            pos.append(p)
            slots.append(req.block_ids[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + num_scheduled)
        seq_lens.append(req.num_computed + num_scheduled)
        if seq_lens[-1] == len(req.token_ids):
            logits_idx.append(starts[-1] - 1)
            samplers.append(req_id)
    width = max(len(reqs[r].block_ids) for r, _ in schedule)
    tables = [reqs[r].block_ids + [0] * (width - len(reqs[r].block_ids)) for r, _ in schedule]
    return ids, pos, slots, logits_idx, seq_lens, starts, tables, samplers


_specs = st.builds(SamplingSpec, temperature=st.sampled_from([0.0, 0.5, 1.0]),
                   top_p=st.sampled_from([1.0, 0.9]), top_k=st.sampled_from([0, 5]),
                   seed=st.one_of(st.none(), st.integers(-2**70, 2**70)),
                   num_logprobs=st.integers(0, 3), append_sampled=st.booleans())


def _check_step(batch: InputBatch, reqs: dict[str, _Req], schedule, block_size: int) -> None:
    rows = np.array([batch.row_of[r] for r, _ in schedule], dtype=np.int64)
    query_lens = np.array([n for _, n in schedule], dtype=np.int64)
    got = build_step_inputs(batch, rows, query_lens, CPU)
    ids, pos, slots, logits_idx, seq_lens, starts, tables, samplers = _reference(
        reqs, schedule, block_size)
    meta = got.batch
    assert got.input_ids.tolist() == ids and got.positions.tolist() == pos
    assert meta.slot_mapping.tolist() == slots and meta.logits_indices.tolist() == logits_idx
    assert meta.seq_lens.tolist() == seq_lens and meta.query_start_loc.tolist() == starts
    assert meta.block_tables.tolist() == tables
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype \
        == torch.int32
    assert got.input_ids.dtype == meta.slot_mapping.dtype == torch.int64
    assert meta.max_query_len == max(query_lens) and meta.max_seq_len == max(seq_lens)
    # The sampling parameters of the rows that sample, in logits order.
    assert [batch.req_ids[r] for r in got.sample_rows] == samplers
    specs = [reqs[r].sampling for r in samplers]
    sampling = got.sampling
    assert sampling.temperature.tolist() == [np.float32(s.temperature) for s in specs]
    assert sampling.top_p.tolist() == [np.float32(s.top_p) for s in specs]
    assert sampling.top_k.tolist() == [s.top_k for s in specs]
    seeded = [i for i, s in enumerate(specs) if s.seed is not None]
    assert sampling.seeded_rows.tolist() == seeded
    assert sampling.seeds.tolist() == [seed_bits(specs[i].seed) for i in seeded]
    assert sampling.token_indices.tolist() == [len(reqs[samplers[i]].token_ids) for i in seeded]
    with_lp = [i for i, s in enumerate(specs) if s.num_logprobs]
    assert got.logprob_rows.tolist() == with_lp
    assert got.num_logprobs.tolist() == [specs[i].num_logprobs for i in with_lp]
    assert sampling.all_greedy == all(s.temperature == 0 for s in specs)


@settings(max_examples=80, deadline=None)
@given(st.data(), st.sampled_from([1, 2, 4, 16]))
def test_persistent_batch_matches_a_rebuild_from_lists(data, block_size):
    batch = InputBatch(MAX_MODEL_LEN, block_size, capacity=2)  # small: rows must grow
    max_blocks = -(-MAX_MODEL_LEN // block_size)
    reqs: dict[str, _Req] = {}
    token = st.integers(0, 5000)
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["add", "add", "blocks", "tokens", "step", "step", "drop"]))
        held = sorted(reqs)
        if op == "add":
            # A new request, a resume after preemption, or a swap-in (KV already computed).
            req_id = data.draw(st.sampled_from([f"r{i}" for i in range(8)]))
            num_tokens = data.draw(st.integers(1, MAX_MODEL_LEN))
            num_blocks = data.draw(st.integers(0, max_blocks))
            computed = data.draw(st.integers(0, min(num_tokens - 1, num_blocks * block_size)))
            req = _Req(data.draw(st.lists(token, min_size=num_tokens, max_size=num_tokens)),
                       data.draw(st.lists(st.integers(0, 999), min_size=num_blocks,
                                          max_size=num_blocks)), computed, data.draw(_specs))
            reqs[req_id] = req
            batch.add(req_id, req.token_ids, req.block_ids, computed, req.sampling)
        elif op == "blocks" and held:
            req_id = data.draw(st.sampled_from(held))
            room = max_blocks - len(reqs[req_id].block_ids)
            new = data.draw(st.lists(st.integers(0, 999), max_size=room))
            reqs[req_id].block_ids += new
            batch.append_blocks(batch.row_of[req_id], new)
        elif op == "tokens" and held:
            req_id = data.draw(st.sampled_from(held))
            room = MAX_MODEL_LEN - len(reqs[req_id].token_ids)
            new = data.draw(st.lists(token, max_size=max(room, 0)))
            reqs[req_id].token_ids += new
            batch.append_tokens(batch.row_of[req_id], new)
        elif op == "drop" and held:
            req_id = data.draw(st.sampled_from(held))
            assert batch.remove(req_id)
            del reqs[req_id]
        elif op == "step":
            _step(data, batch, reqs, block_size)
        _check_held(batch, reqs)


def _step(data, batch: InputBatch, reqs: dict[str, _Req], block_size: int) -> None:
    """Schedule what can run in a random order, compare, then sample and advance."""
    runnable = [r for r, q in reqs.items()
                if q.num_computed < min(len(q.token_ids), len(q.block_ids) * block_size,
                                        MAX_MODEL_LEN)]
    if not runnable:
        return
    order = data.draw(st.permutations(runnable))
    chosen = order[:data.draw(st.integers(1, len(order)))]
    schedule = []
    for req_id in chosen:
        q = reqs[req_id]
        limit = min(len(q.token_ids), len(q.block_ids) * block_size,
                    MAX_MODEL_LEN) - q.num_computed
        schedule.append((req_id, data.draw(st.integers(1, limit))))
    _check_step(batch, reqs, schedule, block_size)
    # Sample: every row that reached its end gets a token, appended where the spec says so.
    rows = np.array([batch.row_of[r] for r, _ in schedule], dtype=np.int64)
    batch.num_computed[rows] += np.array([n for _, n in schedule], dtype=np.int64)
    appending = [r for r, n in schedule if reqs[r].num_computed + n == len(reqs[r].token_ids)
                 and reqs[r].sampling.append_sampled]
    sampled = data.draw(st.lists(st.integers(0, 5000), min_size=len(appending),
                                 max_size=len(appending)))
    batch.append_sampled_tokens(np.array([batch.row_of[r] for r in appending], dtype=np.int64),
                                np.array(sampled, dtype=np.int64))
    for req_id, n in schedule:
        reqs[req_id].num_computed += n
    for req_id, token_id in zip(appending, sampled, strict=True):
        reqs[req_id].token_ids.append(token_id)


def _check_held(batch: InputBatch, reqs: dict[str, _Req]) -> None:
    """Introspection (runner.requests) reads each request back as the oracle holds it, and
    every block-table entry past a row's blocks is 0, in held and free rows alike."""
    assert set(batch) == set(reqs) and len(batch) == len(reqs)
    for req_id, req in reqs.items():
        state = batch[req_id]
        assert (state.token_ids, state.block_ids, state.num_computed_tokens, state.sampling) \
            == (req.token_ids, req.block_ids, req.num_computed, req.sampling)
    past_end = np.arange(batch.max_num_blocks)[None, :] >= batch.num_blocks[:, None]
    assert not batch.block_table[past_end].any()


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(0, 37), min_size=1, max_size=8),
       dtypes=st.lists(st.sampled_from([torch.int64, torch.int32, torch.float32]), min_size=8,
                       max_size=8))
def test_every_staging_segment_starts_16_byte_aligned(counts, dtypes):
    """Triton specializes pointers on 16-byte divisibility: a segment's alignment must not
    depend on the sizes of the segments before it, or a new step shape compiles anew."""
    from executor_svc.step.inputs import _Staging

    staging = _Staging([(f"s{i}", dtypes[i], n) for i, n in enumerate(counts)],
                       torch.device("cpu"))
    for view in staging.to_device().values():
        assert view.data_ptr() % 16 == 0
