"""Decode steps replayed from CUDA graphs, padded to a captured batch size.

A pure-decode step (every scheduled row computes one token) launches hundreds of small
kernels whose host cost exceeds their GPU work at small batches. `DecodeGraphRunner` captures
the decoder (embedding through the final norm) once per batch size at start-up and replays
it; the LM head and the sampler then run eagerly on the real rows only.

Capture sizes are 1, 2, 4, then multiples of 8 up to 256, then of 16 (vLLM's list), up to the
first size that holds ``max_num_seqs`` and never past ``MAX_CAPTURE_SIZE``; they are captured
largest first, all in one memory pool (a smaller graph reuses the larger one's blocks).

Static buffers, allocated once for the largest size and never reallocated (a graph holds their
addresses)::

    input_ids, positions                 [max_size]            int64
    slot_mapping                         [G, max_size]         int64  one row per KV group
    seq_lens                             [max_size]            int32
    query_start_loc                      [max_size + 1]        int32
    block_tables                         [G, max_size, max_num_blocks] int32  (positions)
    logits_indices                       [max_size]            int64  arange: the decoder
                                                                      never reads it
    hidden                               [max_size, hidden_size]      the graph's output

Padding discipline: a step of ``n`` sequences replays the graph of the smallest captured size
``size >= n``. Rows ``n .. size-1`` are padding: input id 0, position 0, slot -1 (store_kv
skips it, so nothing is written to the KV cache), sequence length 0 and query length 0
(``query_start_loc[n+1:] == n``), and an all-zero block-table row. Every attention kernel skips
a sequence with no query tokens, so the padded tokens belong to no sequence; their rows of the
output are left as whatever the kernels leave there, and every other layer is row-wise, so
they cannot reach a real row. Real rows' block-table columns past their step's width are
zeroed, as the eager path pads them.

Captured graphs freeze host values: the metadata says ``max_query_len == 1`` and
``max_seq_len == max_model_len`` (the upper bound any split heuristic must cover).

On the CPU no graph is recorded: "capture" sets up the same static buffers and padding, and a
"replay" copies the step's inputs into them and runs the decoder eagerly on the padded static
batch. That costs the padded rows' compute, so the executor enables it on CUDA only; tests
turn it on for the CPU to prove the bookkeeping token-exact against the eager path. The CUDA
calls themselves are in `_capture_graph` and the one ``replay()`` line.
"""

from __future__ import annotations

import time
from collections import Counter

import structlog
import torch
from torch import nn

from executor_svc.step.batch import BatchMetadata
from executor_svc.step.inputs import StepInputs

log = structlog.get_logger(__name__)

MAX_CAPTURE_SIZE = 512
_NUM_WARMUP = 2  # eager runs before a capture: Triton compiles, the allocator settles


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Ascending batch sizes: every size <= max_num_seqs, plus the first one past it (so a full
    batch still replays a graph), all capped at `limit`."""
    ladder = [1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)]
    sizes = [s for s in ladder if s < max_num_seqs and s <= limit]
    cover = next((s for s in ladder if s >= max_num_seqs), None)
    if cover is not None and cover <= limit:
        sizes.append(cover)
    return sizes


class DecodeGraphRunner:
    """Replays the decoder for pure-decode steps of up to `max_size` sequences.

    Invariants:
    - the static tensors below are allocated in __init__ and only ever written in place;
    - `sizes` is ascending and holds exactly the sizes `capture()` prepared (a graph for each
      when `use_cuda_graphs`);
    - after a replay of size s for n rows, the static rows n..s-1 hold the padding above.
    """

    def __init__(self, model: nn.Module, max_num_seqs: int, max_num_blocks: int,
                 max_model_len: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, use_cuda_graphs: bool, limit: int = MAX_CAPTURE_SIZE,
                 num_kv_groups: int = 1):
        if use_cuda_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.max_model_len = max_model_len
        self.device = device
        self.use_cuda_graphs = use_cuda_graphs
        self.planned_sizes = capture_sizes(max_num_seqs, limit)
        self.sizes: list[int] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None  # the graphs' shared memory pool, from the first (largest) capture
        self.pool_bytes = 0  # memory the caching allocator reserved while capturing (0 on a CPU)
        self.num_replays: Counter[int] = Counter()  # captured size -> steps that replayed it
        max_size = self.planned_sizes[-1]
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(max_size, dtype=i64, device=device)
        self.positions = torch.zeros(max_size, dtype=i64, device=device)
        G = num_kv_groups
        self.slot_mapping = torch.full((G, max_size), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(max_size, dtype=i32, device=device)
        self.query_start_loc = torch.zeros(max_size + 1, dtype=i32, device=device)
        self.block_tables = torch.zeros((G, max_size, max_num_blocks), dtype=i32, device=device)
        self.logits_indices = torch.arange(max_size, dtype=i64, device=device)
        self.hidden = torch.zeros((max_size, hidden_size), dtype=dtype, device=device)

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def fits(self, num_seqs: int, max_query_len: int) -> bool:
        """Whether a step replays a graph: pure decode, within the largest captured size."""
        return max_query_len == 1 and 0 < num_seqs <= self.max_size

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def capture(self) -> None:
        """Prepare every size, largest first (one pool: later, smaller graphs reuse its
        memory). Every captured run is all padding, so capture writes nothing to the KV
        cache."""
        start = time.perf_counter()
        reserved_before = 0
        if self.use_cuda_graphs:  # capture empties the cache first: start the count from there
            torch.cuda.empty_cache()
            reserved_before = torch.cuda.memory_reserved(self.device)
        with torch.inference_mode():
            for size in reversed(self.planned_sizes):
                self._pad(0, size)
                if self.use_cuda_graphs:
                    self.graphs[size] = self._capture_graph(size)
        self.sizes = list(self.planned_sizes)
        if self.use_cuda_graphs:
            self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        log.info("decode graphs ready", sizes=self.sizes, cuda_graphs=self.use_cuda_graphs,
                 pool_mib=round(self.pool_bytes / (1 << 20), 1),
                 seconds=round(time.perf_counter() - start, 2))

    def _capture_graph(self, size: int) -> torch.cuda.CUDAGraph:
        batch = self._static_batch(size)
        for _ in range(_NUM_WARMUP):
            self._forward(size, batch)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(size, batch)
        if self._pool is None:
            self._pool = graph.pool()
        return graph

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The decoder's hidden states of a pure-decode step -> [num_seqs, hidden], a view of
        the static output (valid until the next run)."""
        batch = inputs.batch
        num_seqs = batch.num_seqs
        assert self.fits(num_seqs, batch.max_query_len) and batch.num_tokens == num_seqs
        size = self.padded_size(num_seqs)
        self._copy_inputs(inputs, size)
        self.num_replays[size] += 1
        if self.use_cuda_graphs:
            self.graphs[size].replay()
        else:
            # A fresh metadata object over the same static tensors: the CPU attention backend
            # keys its per-step plan on the object's identity.
            self._forward(size, self._static_batch(size))
        return self.hidden[:num_seqs]

    def _copy_inputs(self, inputs: StepInputs, size: int) -> None:
        batch, n = inputs.batch, inputs.batch.num_seqs
        width = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        self.query_start_loc[:n + 1].copy_(batch.query_start_loc, non_blocking=True)
        for g in range(batch.num_kv_groups):
            group = batch.for_group(g)
            self.slot_mapping[g, :n].copy_(group.slot_mapping, non_blocking=True)
            self.block_tables[g, :n, :width].copy_(group.block_tables, non_blocking=True)
        self.block_tables[:, :n, width:].zero_()
        self._pad(n, size)

    def _pad(self, n: int, size: int) -> None:
        """Rows n..size-1 become padding (see the module docstring)."""
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[:, n:size].fill_(-1)
        self.seq_lens[n:size].zero_()
        self.query_start_loc[n + 1:size + 1].fill_(n)
        self.block_tables[:, n:size].zero_()

    def _static_batch(self, size: int) -> BatchMetadata:
        return BatchMetadata(
            slot_mapping=self.slot_mapping[0, :size],
            block_tables=self.block_tables[0, :size],
            other_groups=tuple((self.slot_mapping[g, :size], self.block_tables[g, :size])
                               for g in range(1, self.slot_mapping.shape[0])),
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            logits_indices=self.logits_indices[:size],
        )

    def _forward(self, size: int, batch: BatchMetadata) -> None:
        hidden = self.model.hidden_states(self.input_ids[:size], self.positions[:size], batch)
        self.hidden[:size].copy_(hidden)  # [size, hidden]
