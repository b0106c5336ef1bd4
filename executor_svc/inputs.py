"""Step inputs: one flattened batch, assembled on the host and sent to the device at once.

The per-token arithmetic runs in numpy (building these small index arrays with torch on the
host costs several times more per step), into one int64 buffer, pinned on CUDA::

    | input_ids | positions | slot_mapping | logits_indices | seq_lens | query_start_loc | block_tables |
      num_tokens  num_tokens  num_tokens     num_logits       num_seqs   num_seqs + 1     num_seqs*max_blocks

That buffer crosses to the device in one asynchronous copy; the pieces are views of the device
copy (the int32 ones converted there), so the step pays one host-to-device transfer, not seven.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from executor_svc.batch import BatchMetadata


def build_inputs(token_chunks: Iterable[Sequence[int]], block_rows: Sequence[Sequence[int]],
                 num_computed: Sequence[int], query_lens: Sequence[int],
                 num_held: Sequence[int], block_size: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, BatchMetadata, np.ndarray]:
    """Per sequence i: its token ids to compute (`token_chunks[i]`, query_lens[i] of them), its
    block table, tokens already computed, and tokens held. Returns (input_ids, positions, batch
    metadata, samples) where samples [num_seqs] bool marks the sequences that sample this step
    (their scheduled tokens reach the end of what they hold), in logits row order."""
    num_seqs = len(block_rows)
    computed = np.asarray(num_computed, dtype=np.int64)  # [num_seqs]
    q_lens = np.asarray(query_lens, dtype=np.int64)  # [num_seqs]
    num_blocks = np.fromiter(map(len, block_rows), dtype=np.int64, count=num_seqs)
    num_tokens, max_blocks = int(q_lens.sum()), int(num_blocks.max())

    seq_lens = computed + q_lens  # [num_seqs]
    samples = seq_lens == np.asarray(num_held, dtype=np.int64)  # prompt done, or a decode step
    num_logits = int(samples.sum())
    sizes = (num_tokens, num_tokens, num_tokens, num_logits, num_seqs, num_seqs + 1,
             num_seqs * max_blocks)
    offsets = np.cumsum((0,) + sizes)
    host = torch.empty(int(offsets[-1]), dtype=torch.int64, pin_memory=device.type == "cuda")
    buf = host.numpy()
    (input_ids, positions, slot_mapping, logits_indices, seq_lens_out, query_start_loc,
     block_flat) = (buf[a:b] for a, b in itertools.pairwise(offsets))

    input_ids[:] = np.fromiter(itertools.chain.from_iterable(token_chunks), dtype=np.int64,
                               count=num_tokens)
    block_tables = block_flat.reshape(num_seqs, max_blocks)  # padded with block 0
    block_tables[:] = 0
    block_tables[np.arange(max_blocks) < num_blocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_rows), dtype=np.int64, count=int(num_blocks.sum()))
    query_start_loc[0] = 0
    np.cumsum(q_lens, out=query_start_loc[1:])
    seq_idx = np.repeat(np.arange(num_seqs), q_lens)  # [num_tokens]
    positions[:] = computed[seq_idx] + np.arange(num_tokens) - query_start_loc[seq_idx]
    slot_mapping[:] = (block_tables[seq_idx, positions // block_size] * block_size
                       + positions % block_size)
    logits_indices[:] = (query_start_loc[1:] - 1)[samples]
    seq_lens_out[:] = seq_lens

    dev = host.to(device, non_blocking=True)
    (d_input_ids, d_positions, d_slot_mapping, d_logits_indices, d_seq_lens, d_query_start_loc,
     d_block_flat) = (dev[a:b] for a, b in itertools.pairwise(offsets))
    batch = BatchMetadata(
        slot_mapping=d_slot_mapping,
        block_tables=d_block_flat.view(num_seqs, max_blocks).to(torch.int32),
        seq_lens=d_seq_lens.to(torch.int32),
        query_start_loc=d_query_start_loc.to(torch.int32),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        logits_indices=d_logits_indices,
    )
    return d_input_ids, d_positions, batch, samples
