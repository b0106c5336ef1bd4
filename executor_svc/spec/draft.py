"""Speculative decoding's draft model: proposals made in the executor, after each step, for
the next one (`--speculative-method draft`).

A second, smaller model sharing the target's tokenizer (or the target's own checkpoint cut
to its first layers: `--speculative-draft-layers`) with a KV cache of its own, laid out like
the target's: the same block ids and block tables, so it needs no allocation of its own from
the scheduler. After a step, each row that sampled and may speculate (SpecVerifier.refusal)
gets up to k greedy proposals: the draft first catches up on the row's real tokens it has not
computed (from `InputBatch.draft_computed` to the last token: the whole sequence for a new or
resumed row, usually one or two tokens), which yields d_0, then runs k - 1 single-token steps.
Greedy proposals are deterministic, so verification treats them as one-hot (verifier.py):
the emitted tokens stay distributed exactly as the target's.

Invariants:
- draft KV at positions < draft_computed[row] holds the draft's KV of the row's real tokens
  (the runner lowers it to the target's computed count after every step, which drops the
  positions of rejected proposals; a new row starts at 0);
- the draft writes KV only into slots of blocks the row holds (the scheduler allocates k
  lookahead slots for speculating decodes): a row proposes at most (its slots - its tokens
  + 1) tokens, and never past max_model_len.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from executor_svc.kv.kv_cache import KVCache, to_device
from executor_svc.loading.loader import load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.step.batch import BatchMetadata
from executor_svc.step.input_batch import InputBatch


class DraftProposer:
    def __init__(self, model: nn.Module, kv_cache: KVCache, num_tokens: int,
                 max_model_len: int, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.k = num_tokens
        self.max_model_len = max_model_len
        self.device = device

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        """Proposals for each of `rows` (settled rows whose last token is sampled, not yet
        computed by the target), in order; rows without room get none."""
        num_tokens = batch.num_tokens[rows]  # [R] T: real tokens
        room = np.minimum(batch.num_blocks[rows] * batch.block_size,
                          self.max_model_len) - num_tokens + 1
        counts = np.clip(room, 0, self.k)  # [R] proposals each
        out: list[list[int]] = [[] for _ in range(len(rows))]
        live = np.flatnonzero(counts > 0)
        if not len(live):
            return out
        rows, num_tokens, counts = rows[live], num_tokens[live], counts[live]
        starts = np.minimum(batch.draft_computed[rows], num_tokens - 1)  # [R]
        proposals = np.zeros((len(rows), int(counts.max())), np.int64)
        proposals[:, 0] = self._step(batch, rows, starts, num_tokens)
        for i in range(1, proposals.shape[1]):
            going = np.flatnonzero(counts > i)
            if not len(going):
                break
            pos = num_tokens[going] - 1 + i  # the input: proposal i - 1, at this position
            batch.token_ids[rows[going], pos] = proposals[going, i - 1]  # scratch, past T
            proposals[going, i] = self._step(batch, rows[going], pos, pos + 1)
        batch.draft_computed[rows] = num_tokens + counts - 1
        for j, i in enumerate(live.tolist()):
            out[i] = proposals[j, :counts[j]].tolist()
        return out

    def _step(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray,
              ends: np.ndarray) -> np.ndarray:
        """One draft forward over positions starts..ends-1 of each row (tokens from
        batch.token_ids): their KV written, the argmax after the last one returned."""
        block_size = batch.block_size
        query_lens = ends - starts  # [R] >= 1
        num_seqs = len(rows)
        query_start_loc = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_idx = np.repeat(np.arange(num_seqs), query_lens)  # [N]
        positions = np.arange(int(query_lens.sum())) - (query_start_loc[:-1] - starts)[seq_idx]
        input_ids = batch.token_ids[rows[seq_idx], positions].astype(np.int64)
        width = int(batch.num_blocks[rows].max())
        block_tables = batch.block_table[rows, :width]  # [R, width] int32
        slots = (block_tables[seq_idx, positions // block_size].astype(np.int64) * block_size
                 + positions % block_size)
        meta = BatchMetadata(
            slot_mapping=to_device(slots, self.device),
            block_tables=to_device(np.ascontiguousarray(block_tables), self.device),
            seq_lens=to_device(ends.astype(np.int32), self.device),
            query_start_loc=to_device(query_start_loc.astype(np.int32), self.device),
            max_query_len=int(query_lens.max()), max_seq_len=int(ends.max()),
            logits_indices=to_device(query_start_loc[1:] - 1, self.device))
        logits = self.model(to_device(input_ids, self.device),
                            to_device(positions.astype(np.int64), self.device), meta)
        return logits.argmax(dim=-1).cpu().numpy()


def load_draft(model_dir: Path, target: ModelConfig, num_layers: int | None, *,
               dtype: torch.dtype, device: torch.device, max_model_len: int
               ) -> tuple[nn.Module, ModelConfig]:
    """The draft model (its first `num_layers` decoder layers, or all) and its config; it must
    share the target's vocabulary (proposals are the target's token ids)."""
    cfg = ModelConfig.from_dir(model_dir)
    if num_layers is not None:
        if num_layers > cfg.num_layers:
            raise ValueError(f"--draft-layers {num_layers}: the draft model has only "
                             f"{cfg.num_layers} decoder layers")
        cfg = cfg.with_num_layers(num_layers)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({cfg.vocab_size} tokens) is not the "
                         f"served model's ({target.vocab_size}): it must share the tokenizer")
    model = load_model(model_dir, dtype=dtype, device=device, max_model_len=max_model_len,
                       cfg=cfg, num_layers=num_layers)
    return model, cfg
