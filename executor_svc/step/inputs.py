"""Step inputs: gathered from the persistent batch's rows, sent to the device in one copy.

Given the rows scheduled this step (in plan order) and how many tokens each computes, every
array is built with numpy indexing over the rows (no per-token or per-block Python loop) into
one host buffer, pinned on CUDA, of 16-byte-aligned typed segments::

    int64:   input_ids | positions | slot_mapping | logits_indices | top_k | seeded_rows | seeds
             | token_indices | logprob_rows | sampled_lp_rows | prompt_targets
    int32:   seq_lens | query_start_loc | block_tables
    float32: temperature | top_p

With KV groups (executor_svc/kv/groups.py), ``slot_mapping`` holds G rows of num_tokens and
``block_tables`` G tables of [num_seqs, positions], group after group: the rows' interleaved
tables (G entries per position) are split by group here, once per step.

Rows that use a logits processor add their segments (``processor_rows.ProcessorInputs``: bans,
allowed ids, biases, penalty histories, min_p) to the same buffer; a step without any adds none.

That buffer crosses to the device in one asynchronous copy and every piece is a typed view of
the device copy, so a step pays one host-to-device transfer and the sampler reads its
parameters from the device without another (on the CPU the "copy" is the buffer itself).

Prompt logprobs: a row whose ``prompt_logprobs >= 0`` also needs the logits of every computed
position that has a next token held (its prompt positions: the scheduler asks only while the
prompt's logprobs are owed). Their flattened token indices follow the sampling rows' in
``logits_indices`` (``[num_logits + num_prompt_positions]``), so the model computes logits for
them and the sampler still reads rows ``:num_logits``; ``prompt_targets`` holds the next token
of each. Steps where no row asks add nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.sample.logits_processors import LogitsProcessing
from executor_svc.sample.processor_rows import ProcessorInputs
from executor_svc.sample.sampler import GREEDY_EPS, SamplingBatch
from executor_svc.step.batch import BatchMetadata
from executor_svc.step.input_batch import InputBatch

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    batch: BatchMetadata
    sample_rows: np.ndarray  # [num_logits] int64: persistent-batch rows that sample, logits order
    sampling: SamplingBatch  # one row per logits row
    logprob_rows: torch.Tensor  # [num_lp] int64: logits rows that asked for top logprobs
    logprob_rows_host: np.ndarray  # [num_lp] int64: the same, on the host
    num_logprobs: np.ndarray  # [num_lp] int64: how many each asked for
    sampled_lp_rows: torch.Tensor  # [num_slp] int64: logits rows that want the sampled logprob
    sampled_lp_rows_host: np.ndarray  # [num_slp] int64: the same, on the host
    prompt_targets: torch.Tensor  # [num_prompt_positions] int64: the next token of each
    prompt_lp: PromptPositions | None  # None when no row asks for prompt logprobs
    spec: SpecPositions | None = None  # None when no row verifies proposals


@dataclass(frozen=True)
class PromptPositions:
    """The rows computing prompt logprobs this step, in logits order after the sampling rows."""

    rows: np.ndarray  # [num_pl_seqs] int64: persistent-batch rows
    starts: np.ndarray  # [num_pl_seqs] int64: index of the first prompt token covered (>= 1)
    counts: np.ndarray  # [num_pl_seqs] int64 >= 0: positions of each
    num_top: np.ndarray  # [num_pl_seqs] int64: alternatives each asked for


@dataclass(frozen=True)
class SpecPositions:
    """Rows verifying speculative proposals: the logits of their first `counts` query
    positions (each predicts one proposal) follow the sampling and prompt rows' in
    ``logits_indices``, from row `start`, row after row; the row's own sampling row predicts
    the token after its last proposal."""

    rows: np.ndarray  # [num_spec_seqs] int64: persistent-batch rows
    logits_rows: np.ndarray  # [num_spec_seqs] int64: their sampling rows (into sample_rows)
    counts: np.ndarray  # [num_spec_seqs] int64 >= 1: proposals of each
    start: int  # first logits row of the proposals' positions


ALIGN = 16  # bytes, of every staging segment's start


class _Staging:
    """One host buffer of named typed segments, copied to the device at once."""

    def __init__(self, segments: list[tuple[str, torch.dtype, int]], device: torch.device):
        self.spans: dict[str, tuple[int, int, torch.dtype]] = {}
        offset = 0
        for name, dtype, count in segments:
            nbytes = count * dtype.itemsize
            self.spans[name] = (offset, offset + nbytes, dtype)
            # Every segment 16-byte aligned: Triton specializes a kernel's pointer arguments
            # on 16-byte divisibility, so an alignment that followed the step's sizes would
            # compile new variants mid-serving.
            offset += -(-nbytes // ALIGN) * ALIGN
        self.host = torch.empty(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device = device
        raw = self.host.numpy()
        self.np = {name: raw[a:b].view(_NUMPY_DTYPES[dtype])
                   for name, (a, b, dtype) in self.spans.items()}

    def to_device(self) -> dict[str, torch.Tensor]:
        dev = self.host.to(self.device, non_blocking=True)
        return {name: dev[a:b].view(dtype) for name, (a, b, dtype) in self.spans.items()}


def build_step_inputs(ib: InputBatch, rows: np.ndarray, query_lens: np.ndarray,
                      device: torch.device) -> StepInputs:
    """rows [num_seqs] int64 (distinct, held), query_lens [num_seqs] int64 >= 1: the tokens
    ``num_computed[row] .. num_computed[row] + query_len - 1`` of each row are computed. A row
    samples when that reaches the end of the tokens it holds (prompt done, or a decode)."""
    num_seqs, block_size = len(rows), ib.block_size
    computed = ib.num_computed[rows]  # [num_seqs]
    seq_lens = computed + query_lens  # [num_seqs]
    samples = seq_lens == ib.num_tokens[rows]  # [num_seqs] bool
    sample_rows = rows[samples]  # [num_logits]
    num_tokens, num_logits = int(query_lens.sum()), len(sample_rows)
    G = ib.num_kv_groups
    width = int(ib.num_blocks[rows].max())  # block table entries this step (G per position)
    seeded = np.flatnonzero(ib.has_seed[sample_rows])  # [num_seeded] logits rows
    logprob_rows = np.flatnonzero(ib.num_logprobs[sample_rows])  # [num_lp] logits rows
    sampled_lp = np.flatnonzero(ib.sampled_logprob[sample_rows])  # [num_slp] logits rows
    pl_seqs = np.flatnonzero(ib.prompt_logprobs[rows] >= 0)  # [num_pl_seqs] into rows
    pl_counts = query_lens[pl_seqs] - samples[pl_seqs]  # the sampling position has no next
    num_pl = int(pl_counts.sum())
    spec_seqs = np.flatnonzero(ib.num_spec[rows])  # [num_spec_seqs] into rows: all sample
    spec_counts = ib.num_spec[rows[spec_seqs]]
    num_spec = int(spec_counts.sum())
    processors = ib.processors.gather(sample_rows, ib.token_ids, ib.num_tokens, ib.num_prompt)
    i64, i32, f32 = torch.int64, torch.int32, torch.float32
    extra = _processor_segments(processors) if processors is not None else []
    stage = _Staging(extra + [
        ("input_ids", i64, num_tokens), ("positions", i64, num_tokens),
        ("slot_mapping", i64, G * num_tokens),
        ("logits_indices", i64, num_logits + num_pl + num_spec),
        ("top_k", i64, num_logits), ("seeded_rows", i64, len(seeded)),
        ("seeds", i64, len(seeded)), ("token_indices", i64, len(seeded)),
        ("logprob_rows", i64, len(logprob_rows)), ("sampled_lp_rows", i64, len(sampled_lp)),
        ("prompt_targets", i64, num_pl),
        ("seq_lens", i32, num_seqs), ("query_start_loc", i32, num_seqs + 1),
        ("block_tables", i32, num_seqs * width),
        ("temperature", f32, num_logits), ("top_p", f32, num_logits)], device)
    h = stage.np

    query_start_loc = h["query_start_loc"]
    query_start_loc[0] = 0
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_idx = np.repeat(np.arange(num_seqs), query_lens)  # [num_tokens]
    positions = h["positions"]
    positions[:] = np.arange(num_tokens) - (query_start_loc[:-1] - computed)[seq_idx]
    h["input_ids"][:] = ib.token_ids[rows[seq_idx], positions]
    # Padded with 0 (InputBatch).
    if G == 1:
        block_tables = h["block_tables"].reshape(1, num_seqs, width)
        np.take(ib.block_table[:, :width], rows, axis=0, out=block_tables[0])
    else:
        block_tables = h["block_tables"].reshape(G, num_seqs, width // G)
        block_tables[:] = ib.block_table[rows, :width].reshape(
            num_seqs, width // G, G).transpose(2, 0, 1)
    slots = h["slot_mapping"].reshape(G, num_tokens)
    block_of, offset = positions // block_size, positions % block_size
    for g in range(G):
        slots[g] = block_tables[g][seq_idx, block_of].astype(np.int64) * block_size + offset
    h["logits_indices"][:num_logits] = (query_start_loc[1:] - 1)[samples]
    prompt_lp = None
    if len(pl_seqs):
        # Position j of prompt row i: token index query_start_loc[i] + j, next token at
        # computed[i] + j + 1 (numpy only: a repeat and an arange, no loop over positions).
        within = np.arange(num_pl) - np.repeat(np.cumsum(pl_counts) - pl_counts, pl_counts)
        h["logits_indices"][num_logits:num_logits + num_pl] = np.repeat(
            query_start_loc[:-1][pl_seqs], pl_counts) + within  # the proposals' rows follow
        h["prompt_targets"][:] = ib.token_ids[np.repeat(rows[pl_seqs], pl_counts),
                                              np.repeat(computed[pl_seqs], pl_counts) + within + 1]
        prompt_lp = PromptPositions(rows[pl_seqs], computed[pl_seqs] + 1, pl_counts,
                                    ib.prompt_logprobs[rows[pl_seqs]])
    spec = None
    if num_spec:
        within = np.arange(num_spec) - np.repeat(np.cumsum(spec_counts) - spec_counts,
                                                 spec_counts)
        h["logits_indices"][num_logits + num_pl:] = np.repeat(
            query_start_loc[:-1][spec_seqs], spec_counts) + within
        spec = SpecPositions(rows[spec_seqs], (np.cumsum(samples) - 1)[spec_seqs],
                             spec_counts, num_logits + num_pl)
    h["seq_lens"][:] = seq_lens

    temperature = h["temperature"]
    temperature[:] = ib.temperature[sample_rows]
    h["top_p"][:] = ib.top_p[sample_rows]
    h["top_k"][:] = ib.top_k[sample_rows]
    h["seeded_rows"][:] = seeded
    h["seeds"][:] = ib.seed[sample_rows[seeded]]
    h["token_indices"][:] = ib.num_tokens[sample_rows[seeded]]  # the sampled token's index
    h["logprob_rows"][:] = logprob_rows
    h["sampled_lp_rows"][:] = sampled_lp

    if processors is not None:
        for name, _, _ in extra:
            h[name][:] = getattr(processors, name).reshape(-1)
    d = stage.to_device()
    dev_slots = d["slot_mapping"].view(G, num_tokens)
    dev_tables = d["block_tables"].view(G, num_seqs, width // G)
    batch = BatchMetadata(
        slot_mapping=dev_slots[0],
        block_tables=dev_tables[0],
        other_groups=tuple((dev_slots[g], dev_tables[g]) for g in range(1, G)),
        seq_lens=d["seq_lens"],
        query_start_loc=d["query_start_loc"],
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        logits_indices=d["logits_indices"],
    )
    sampling = SamplingBatch(
        temperature=d["temperature"], top_p=d["top_p"], top_k=d["top_k"],
        seeded_rows=d["seeded_rows"], seeds=d["seeds"], token_indices=d["token_indices"],
        all_greedy=bool((temperature < GREEDY_EPS).all()),
        any_filter=bool((h["top_p"] < 1.0).any() or (h["top_k"] > 0).any()),
        processing=_processing(d, processors) if processors is not None else None,
    )
    return StepInputs(d["input_ids"], d["positions"], batch, sample_rows, sampling,
                      d["logprob_rows"], logprob_rows,
                      ib.num_logprobs[sample_rows[logprob_rows]],
                      d["sampled_lp_rows"], sampled_lp, d["prompt_targets"], prompt_lp, spec)


def _processor_segments(p: ProcessorInputs) -> list[tuple[str, torch.dtype, int]]:
    """The staging segments of one step's processor inputs (empty ones cost nothing)."""
    i64, i32, f32 = torch.int64, torch.int32, torch.float32
    segments = [(name, i64, len(getattr(p, name))) for name in (
        "ban_rows", "ban_ids", "restricted_rows", "allowed_rows", "allowed_ids", "bias_rows",
        "bias_ids", "penalty_rows", "penalty_num_prompt", "penalty_num_tokens")]
    segments += [("penalty_history", i32, p.penalty_history.size)]
    segments += [(name, f32, len(getattr(p, name)))
                 for name in ("bias_values", "repetition", "presence", "frequency")]
    if p.min_p is not None:
        segments.append(("min_p", f32, len(p.min_p)))
    return segments


def _processing(d: dict[str, torch.Tensor], p: ProcessorInputs) -> LogitsProcessing:
    """The device mirror of `p`: every field under its own name, the 2-D history reshaped and
    min_p left out when no row uses it."""
    fields = {f.name: d.get(f.name) for f in dataclasses.fields(LogitsProcessing)}
    fields["penalty_history"] = fields["penalty_history"].view(p.penalty_history.shape)
    if p.min_p is None:
        fields["min_p"] = None
    return LogitsProcessing(**fields)
