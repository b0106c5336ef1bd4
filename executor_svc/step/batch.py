"""Forward metadata: everything a model needs about this step's batch, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchMetadata:
    """Attention metadata for one forward pass over a flat, ragged batch of tokens.

    Sequence i owns token rows ``query_start_loc[i] : query_start_loc[i+1]``; those rows are its
    positions ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``. The new tokens' K/V go to
    `slot_mapping` (slot = block_id * block_size + offset), and attention reads each sequence's
    context through its row of `block_tables`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    logits_indices: torch.Tensor  # [num_logits] int64: token rows whose logits are needed

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
