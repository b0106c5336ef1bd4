"""The vectorised step inputs equal a token-by-token reference written the slow, obvious way."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.inputs import build_inputs

CPU = torch.device("cpu")


@st.composite
def _batches(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    seqs = []
    for _ in range(draw(st.integers(1, 8))):
        num_held = draw(st.integers(1, 70))
        computed = draw(st.integers(0, num_held - 1))
        num_scheduled = draw(st.integers(1, num_held - computed))
        num_blocks = -(-(computed + num_scheduled) // block_size) + draw(st.integers(0, 2))
        token_ids = draw(st.lists(st.integers(0, 5000), min_size=num_held, max_size=num_held))
        block_ids = draw(st.lists(st.integers(0, 999), min_size=num_blocks, max_size=num_blocks))
        seqs.append((token_ids, block_ids, computed, num_scheduled))
    return block_size, seqs


@settings(max_examples=60, deadline=None)
@given(_batches())
def test_build_inputs_matches_a_per_token_reference(batch):
    block_size, seqs = batch
    input_ids, positions, meta, samples = build_inputs(
        [t[c:c + n] for t, _, c, n in seqs], [b for _, b, _, _ in seqs],
        [c for *_, c, _ in seqs], [n for *_, n in seqs], [len(t) for t, *_ in seqs],
        block_size, CPU)

    ref_ids, ref_pos, ref_slots, ref_logits, ref_samples, start = [], [], [], [], [], 0
    for token_ids, block_ids, computed, num_scheduled in seqs:
        for pos in range(computed, computed + num_scheduled):
            ref_ids.append(token_ids[pos])
            ref_pos.append(pos)
            ref_slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
        start += num_scheduled
        ref_samples.append(computed + num_scheduled == len(token_ids))
        if ref_samples[-1]:
            ref_logits.append(start - 1)
    max_blocks = max(len(b) for _, b, _, _ in seqs)

    assert input_ids.tolist() == ref_ids and positions.tolist() == ref_pos
    assert meta.slot_mapping.tolist() == ref_slots and meta.slot_mapping.dtype == torch.int64
    assert meta.logits_indices.tolist() == ref_logits and samples.tolist() == ref_samples
    assert meta.block_tables.dtype == meta.seq_lens.dtype == meta.query_start_loc.dtype \
        == torch.int32
    assert meta.block_tables.tolist() == [b + [0] * (max_blocks - len(b)) for _, b, _, _ in seqs]
    assert meta.seq_lens.tolist() == [c + n for *_, c, n in seqs]
    assert meta.query_start_loc.tolist() == [sum(n for *_, n in seqs[:i])
                                             for i in range(len(seqs) + 1)]
    assert meta.max_query_len == max(n for *_, n in seqs)
    assert meta.max_seq_len == max(c + n for *_, c, n in seqs)
