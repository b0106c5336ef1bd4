"""Forward metadata: everything a model needs about this step's batch, passed explicitly."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class BatchMetadata:
    """Attention metadata for one forward pass over a flat, ragged batch of tokens.

    Sequence i owns token rows ``query_start_loc[i] : query_start_loc[i+1]``; those rows are its
    positions ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``. The new tokens' K/V go to
    `slot_mapping` (slot = block_id * block_size + offset), and attention reads each sequence's
    context through its row of `block_tables`.

    KV groups (executor_svc/kv/groups.py): `slot_mapping` and `block_tables` are group 0's;
    `other_groups` holds the (slot_mapping, block_tables) of groups 1.. . `for_group(g)` is
    the metadata a layer of group g attends with (group 0: this object).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    logits_indices: torch.Tensor  # [num_logits] int64: token rows whose logits are needed
    other_groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    kv_group: int = 0  # the group whose slots and tables these are

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_kv_groups(self) -> int:
        return 1 + len(self.other_groups)

    @cached_property
    def _groups(self) -> tuple[BatchMetadata, ...]:
        # Built once per step, on first use: the objects stay the same for every layer, so a
        # backend may key per-step work on them.
        return (self, *(dataclasses.replace(self, slot_mapping=slots, block_tables=tables,
                                            other_groups=(), kv_group=g + 1)
                        for g, (slots, tables) in enumerate(self.other_groups)))

    def for_group(self, group: int) -> BatchMetadata:
        return self if group == 0 else self._groups[group]
