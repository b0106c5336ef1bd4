"""paged_attention: causal attention of a varlen query batch over the paged KV cache (Triton).

One kernel covers decode, prefill and chunked prefill. A program owns one tile of query rows of
one sequence, one KV head and one split of the keys; the rows are (token, q head) pairs, so every
q head sharing the KV head reads each K/V tile once (GQA packing):

    rows of a tile, GROUP_PAD = 4:   row r -> token r // 4, head kv_head * group + r % 4
    r:  0  1  2  3 | 4  5  6  7 | ...
        t0 t0 t0 t0 | t1 t1 t1 t1 | ...

Query token j of a sequence sits at position seq_len - q_len + j and sees keys 0..its position:
full attention to the cached prefix, causal over the new tokens. Key tiles that every query of
the tile sees run without the mask; only the tiles at the edges pay for it.

Variants (twins.paged_attention defines them; scores in natural-log units after `scale`):
- Sliding window (`window` > 0, a runtime int, never specialized on: one compile serves every
  window, 0 = none): a query at position p sees keys p - window + 1..p. A tile's key range
  starts at the key tile (BLOCK_N keys, aligned) holding its first query's window start, so no
  key below that start is ever read: the tiles below are never visited and the loads of that
  first tile mask its keys below the start (a tile wider than a KV block may name blocks the
  block manager freed and reused; their ids are read, their contents never). Tiles that
  straddle some row's window start, like the causal tail, run in the masked loop; the
  unmasked loop takes only tiles every row of the tile sees whole.
- Logit soft-capping (`softcap` > 0, constexpr HAS_SOFTCAP): s -> softcap * tanh(s / softcap)
  before the softmax. The kernel works in log2 units (s * log2 e, for exp2); there the cap is
  softcap * log2 e and tanh's argument is the same natural ratio s / softcap. tanh is computed
  by exp2 (the interpreter and some Triton versions have none).
- Attention sinks (`sinks`, [num_heads], constexpr HAS_SINKS): one logit per q head joins the
  softmax's denominator and its weight is dropped. Without splits the kernel adds exp(sink - m)
  to the final denominator; with splits the merge does (the merged lse plus the sink). Rows with
  no key get zeros.

Query tiles: a launch is a flattened grid of query blocks of BLOCK_Q tokens over all sequences.
Sequence i's blocks start at query_start_loc[i] // BLOCK_Q + i, so num_tokens // BLOCK_Q +
num_seqs blocks cover any batch and a program finds its sequence by binary search. Sequences
with at most SHORT_Q query tokens (decodes) run in the launch of 16-row tiles; longer ones
(prefill chunks) in a second launch of wide tiles, so a mixed step never demotes its decodes.

Split-KV on the device: a launch has a fixed upper bound `max_splits` (from the grid's shape
only); each tile cuts its key range (from its first key tile, the window's, to its last query)
into min(max_splits, ceil(keys / min_split_len)) splits of whole key tiles, computed from the
sequence's length in the kernel. Every split writes a normalized partial output and its
log-sum-exp (base 2) to fp32 scratch, an unused split only lse = -inf;
kernels/attention_reduce.py merges them (and adds the sinks). Nothing depends on host ints that change
with the contents of the batch, so a captured launch stays exact when lengths change.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels.attention_reduce import LOG2E, merge_splits

MIN_SPLIT_LEN = 256  # shorter splits cost more in the merge than they win in parallelism
MAX_SPLITS = 64


@triton.jit
def _kv_offsets(block_ids, start, stride_cache_b, stride_cache_s, head_off,
                BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """[BLOCK_N] cache offsets of keys start.. from the tile's block ids (one per KV block)."""
    SUB: tl.constexpr = BLOCK_N if BLOCK_N < KV_BLOCK_SIZE else KV_BLOCK_SIZE
    in_block = (start % KV_BLOCK_SIZE) + tl.arange(0, SUB)  # [SUB] rows inside each block
    off = block_ids.to(tl.int64)[:, None] * stride_cache_b + (in_block * stride_cache_s)[None, :]
    return tl.reshape(off, [BLOCK_N]) + head_off


@triton.jit
def _block_ids(block_table_ptr, start, hi,
               BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """The physical ids of the KV blocks under key tile start..start+BLOCK_N (0 past hi)."""
    PER_TILE: tl.constexpr = BLOCK_N // KV_BLOCK_SIZE if BLOCK_N > KV_BLOCK_SIZE else 1
    idx = start // KV_BLOCK_SIZE + tl.arange(0, PER_TILE)
    return tl.load(block_table_ptr + idx, mask=idx * KV_BLOCK_SIZE < hi, other=0)


@triton.jit
def _softcap(s, softcap_log2e):
    """softcap * tanh(s_nat / softcap) in log2 units, for scores s = s_nat * log2(e): the
    ratio s / (softcap * log2 e) is the natural-log score over softcap, so capping in log2
    units by softcap * log2(e) is the natural capping converted. tanh by exp2 (neither all
    Triton versions nor the interpreter have one): (1 - e) / (1 + e), e = exp(-2|x|); its
    absolute error (~1e-7) is what matters, the result is scaled by the cap."""
    x = s / softcap_log2e
    e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return softcap_log2e * tl.where(x < 0.0, -t, t)


@triton.jit
def _attend(
    acc, l_i, m_i, q, q_pos, row_lo, k_cache_ptr, v_cache_ptr, block_table_ptr, head_off,
    stride_cache_b, stride_cache_s, lo, gap_lo, gap_hi, hi, key_lo, scale_log2e, softcap_log2e,
    k_scale_ptr, v_scale_ptr, stride_scale_b, stride_scale_s, head_scale_off,
    MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, EVICTION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):  # fmt: skip
    """Key tiles lo..hi less the gap gap_lo..gap_hi (multiples of BLOCK_N; the masked loop's
    tiles below and above the unmasked ones), walked as one loop over a gapless index. Masked:
    row r sees keys row_lo[r]..q_pos[r]; no key below key_lo (the first key any row sees) or
    from hi on is read. KV_QUANT: the cache holds int8/fp8 codes, widened to q's dtype; each
    key's scale multiplies its scores and each value's its softmax weights (after the row sums),
    so the tile computes attention over code * scale (kernels/kv_quant.py)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    gap = gap_hi - gap_lo
    # The next tile's block ids are loaded one iteration ahead (a loop-carried value), so the
    # K/V loads of an iteration depend on no load of the same iteration and the pipeliner can
    # keep NUM_STAGES - 1 tiles of K and V in flight.
    first = lo
    if MASKED:
        first = tl.where(lo < gap_lo, lo, lo + gap)
    block_ids = _block_ids(block_table_ptr, first, hi, BLOCK_N, KV_BLOCK_SIZE)
    for index in tl.range(lo, hi - gap, BLOCK_N, num_stages=NUM_STAGES):
        if MASKED:
            start = tl.where(index < gap_lo, index, index + gap)
            after = index + BLOCK_N
            next_start = tl.where(after < gap_lo, after, after + gap)
        else:
            start = index
            next_start = index + BLOCK_N
        kv_off = _kv_offsets(block_ids, start, stride_cache_b, stride_cache_s, head_off,
                             BLOCK_N, KV_BLOCK_SIZE)  # fmt: skip
        if KV_QUANT:
            scale_off = _kv_offsets(block_ids, start, stride_scale_b, stride_scale_s,
                                    head_scale_off, BLOCK_N, KV_BLOCK_SIZE)  # fmt: skip
        block_ids = _block_ids(block_table_ptr, next_start, hi, BLOCK_N, KV_BLOCK_SIZE)
        kv_pos = start + offs_n  # [BLOCK_N]
        kv_valid = (kv_pos < hi) & (kv_pos >= key_lo)
        k_ptrs = k_cache_ptr + kv_off[None, :] + offs_d[:, None]  # [HEAD_DIM_PAD, BLOCK_N]
        v_ptrs = v_cache_ptr + kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            k = tl.load(k_ptrs, mask=kv_valid[None, :] & d_mask[:, None], other=0.0,
                        eviction_policy=EVICTION)  # fmt: skip
            v = tl.load(v_ptrs, mask=kv_valid[:, None] & d_mask[None, :], other=0.0,
                        eviction_policy=EVICTION)  # fmt: skip
        else:  # the unmasked loop's tiles are whole (lo and its end are multiples of BLOCK_N)
            k = tl.load(k_ptrs, eviction_policy=EVICTION)
            v = tl.load(v_ptrs, eviction_policy=EVICTION)
        if KV_QUANT:
            if MASKED:
                k_scale = tl.load(k_scale_ptr + scale_off, mask=kv_valid, other=0.0)
                v_scale = tl.load(v_scale_ptr + scale_off, mask=kv_valid, other=0.0)
            else:
                k_scale = tl.load(k_scale_ptr + scale_off)
                v_scale = tl.load(v_scale_ptr + scale_off)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * (k_scale * scale_log2e)[None, :]
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = _softcap(s, softcap_log2e)
        if MASKED:
            visible = ((kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] >= row_lo[:, None])
                       & kv_valid[None, :])  # fmt: skip
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no visible key yet keep m = -inf; shift them by 0, not by -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _find_sequence(query_start_loc_ptr, block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first query block query_start_loc[i] // BLOCK_Q + i <= block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Per-step values are never specialized on (==1, %16), so launches never recompile per step;
# nor is the window (one compile serves every window, 0 included).
PER_STEP_ARGS = ["stride_bt", "stride_lse_t", "stride_lse_h", "stride_p_t", "stride_p_h",
                 "stride_p_s", "num_seqs", "max_splits", "min_split_len", "window"]  # fmt: skip


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, partial_ptr, lse_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_t, stride_q_h, stride_cache_b, stride_cache_s, stride_cache_h, stride_bt,
    stride_scale_b, stride_scale_s, stride_scale_h,
    stride_out_t, stride_out_h, stride_p_t, stride_p_h, stride_p_s, stride_lse_t, stride_lse_h,
    num_seqs, max_splits, min_split_len, window, scale_log2e, softcap_log2e,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, SHORT_Q: tl.constexpr, LONG: tl.constexpr,
    SPLIT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, EVICTION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # This launch's sequences: the short ones (decodes, one tile each: block = sequence) or the
    # long ones (the flattened grid of query blocks), never both.
    if LONG:
        seq = _find_sequence(query_start_loc_ptr, block, num_seqs, BLOCK_Q)
    else:
        seq = block
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if LONG:
        q_tile = block - (q_start // BLOCK_Q + seq)
        skip = (q_len <= SHORT_Q) | (q_tile * BLOCK_Q >= q_len)
    else:
        q_tile = 0
        skip = (q_len > SHORT_Q) | (q_len == 0)
    if skip:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + q_tile * BLOCK_Q  # position of the tile's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP_PAD  # [BLOCK_M]
    row_valid = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    q_pos = seq_len - q_len + tok  # [BLOCK_M]
    token_ids = (q_start + tok).to(tl.int64)
    io_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)

    # Keys this tile needs: from the first one its first query sees (the window's start) to its
    # last query; the last query sits at kv_end - 1. A window of 0 is none: a span past every
    # position. Row r sees row_lo[r]..q_pos[r].
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    span = tl.where(window > 0, window, 1 << 30)
    key_lo = tl.maximum(first_pos - span + 1, 0)
    row_lo = q_pos - span + 1  # [BLOCK_M]
    lo = (key_lo // BLOCK_N) * BLOCK_N  # never below: those blocks may have been freed
    hi = kv_end
    if SPLIT:  # this split's share of lo..kv_end, whole key tiles
        keys = kv_end - lo
        num_splits = tl.minimum(tl.maximum(tl.cdiv(keys, min_split_len), 1), max_splits)
        split_len = tl.cdiv(tl.cdiv(keys, num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * split_len
        hi = tl.minimum(kv_end, lo + split_len)
        lse_off = token_ids * stride_lse_t + head * stride_lse_h + split
        if lo >= hi:  # an unused split weighs nothing in the merge
            tl.store(lse_ptr + lse_off, tl.full([BLOCK_M], float("-inf"), tl.float32),
                     mask=row_valid)  # fmt: skip
            return
    q = tl.load(
        q_ptr + token_ids[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    # Whole key tiles that every row sees run without the mask: from the last query's window
    # start (rounded up) to the first query's position (rounded down). The masked loop takes
    # the tiles below them (straddling window starts) and above them (the causal tail).
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(kv_end - span, 0), BLOCK_N) * BLOCK_N,
                                   lo), hi)  # fmt: skip
    mid_hi = tl.minimum((hi // BLOCK_N) * BLOCK_N, ((first_pos + 1) // BLOCK_N) * BLOCK_N)
    mid_hi = tl.maximum(mid_hi, mid_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_cache_h
    head_scale_off = kv_head * stride_scale_h
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_pos, row_lo, k_cache_ptr, v_cache_ptr, block_table_ptr, head_off,
        stride_cache_b, stride_cache_s, mid_lo, mid_hi, mid_hi, mid_hi, key_lo, scale_log2e,
        softcap_log2e, k_scale_ptr, v_scale_ptr, stride_scale_b, stride_scale_s, head_scale_off,
        False, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE,
        DOT_PRECISION, NUM_STAGES, EVICTION, KV_QUANT,
    )  # fmt: skip
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_pos, row_lo, k_cache_ptr, v_cache_ptr, block_table_ptr, head_off,
        stride_cache_b, stride_cache_s, lo, mid_lo, mid_hi, hi, key_lo, scale_log2e,
        softcap_log2e, k_scale_ptr, v_scale_ptr, stride_scale_b, stride_scale_s, head_scale_off,
        True, HAS_SOFTCAP, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE,
        DOT_PRECISION, NUM_STAGES, EVICTION, KV_QUANT,
    )  # fmt: skip

    if SPLIT:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        p_off = token_ids[:, None] * stride_p_t + head[:, None] * stride_p_h + offs_d[None, :]
        tl.store(partial_ptr + p_off + split * stride_p_s, o, mask=io_mask)
        # Rows with no visible key in this split weigh nothing in the merge (which adds the
        # sinks).
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.maximum(l_i, 1e-30)))
        tl.store(lse_ptr + lse_off, lse, mask=row_valid)
    else:
        denom = l_i
        if HAS_SINKS:  # the sink's exp joins the denominator; its weight is dropped
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf"))
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            denom += tl.math.exp2(sink.to(tl.float32) * LOG2E - m_safe)
        # A row with no key (acc = 0) gets zeros.
        o = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        out_off = token_ids[:, None] * stride_out_t + head[:, None] * stride_out_h
        tl.store(out_ptr + out_off + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=io_mask)  # fmt: skip


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no parallelism to fill, never split unless asked
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_max_splits(num_warps: int, device: torch.device) -> int:
    """The split bound of a step's launches, which run num_warps warps in all (programs x
    their warps): from the grid's shape alone."""
    # Enough resident warps per SM to hide memory latency: 32 (the H200 sweeps: 8 programs of
    # 4 warps per SM beat 4; 32 programs of one warp beat 8 and 16 by 10-50%).
    target = 32 * _num_sms(device)
    return 1 if num_warps >= target else min(triton.cdiv(target, num_warps), MAX_SPLITS)


def launch_config(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, long: bool
) -> dict:
    """Tile sizes and launch options of the short (decode) or long (prefill) launch; shared
    with the sm_90 compile test."""
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    fp32 = dtype == torch.float32
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # 16 rows is tl.dot's floor: decode tiles pad to it (or to the group). Prefill tiles take
    # 128 rows (64 past head_dim 128, for registers; on the H200, 256 rows ran 1 x 8k 8% faster
    # and 2 x 4k 11% slower). fp32 is a correctness path on GPUs (exact dots run on FMA units,
    # not tensor cores): small tiles keep its register spills small.
    rows = (32 if fp32 else 128 if head_dim_pad <= 128 else 64) if long else 16
    block_m = max(rows, group_pad)
    # 16-bit decode tiles run in one warp (two past head_dim 128, for registers): a 16-row dot
    # spread over several warps splits the keys between them, so every iteration passes P
    # through shared memory behind a barrier; one warp keeps the iteration in registers and
    # many small programs per SM keep the loads in flight. (H200, 8B shapes: 2.3 -> 2.9 TB/s
    # at 64 x 16k; bench/results/2026-11-26-h200-decode-experiments.md.)
    if long or fp32:
        block_n, stages, warps = (32 if fp32 or head_dim_pad > 128 else 64), 3, 8
    else:
        block_n, stages, warps = 16, 4, 1 if head_dim_pad <= 128 else 2
    return dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_Q=block_m // group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        DOT_PRECISION="ieee" if fp32 else "tf32",  # fp32 stays exact; ignored for 16-bit
        NUM_STAGES=stages,  # K/V tiles in flight while one is computed on: stages - 1
        # Decode streams K/V once: evict first, keep L2 for the block tables and the prefill's
        # reused tiles (+3-6% on the H200).
        EVICTION="" if long else "evict_first",
        num_warps=warps,
    )  # fmt: skip


def plan_launches(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                  num_tokens: int, num_seqs: int, max_query_len: int) -> list[tuple[dict, int]]:
    """(config, query blocks) per launch: the short launch (one block per sequence, sequences
    of at most its BLOCK_Q query tokens) always; the long one (the flattened grid of wide
    query blocks) when some sequence may have more."""
    short = launch_config(dtype, num_heads, num_kv_heads, head_dim, long=False)
    launches = [(short, num_seqs)]
    if max_query_len > short["BLOCK_Q"]:
        long = launch_config(dtype, num_heads, num_kv_heads, head_dim, long=True)
        launches.append((long, num_tokens // long["BLOCK_Q"] + num_seqs))
    return launches


def alloc_scratch(num_tokens: int, num_heads: int, head_dim: int, max_splits: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV scratch (partial outputs, lse) for up to num_tokens rows and max_splits splits;
    a caller that captures graphs allocates it once and passes it to every launch."""
    partial = torch.empty((num_tokens, num_heads, max_splits, head_dim), dtype=torch.float32,
                          device=device)  # fmt: skip
    lse = torch.empty((num_tokens, num_heads, max_splits), dtype=torch.float32, device=device)
    return partial, lse


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,  # must be >= every query length: whether a long launch is needed
    max_seq_len: int,  # unused: splits follow the lengths on the device (kept for the twins' signature)
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    num_splits: int | None = None,  # split bound; None = from the grid's shape (tests force it)
    min_split_len: int = MIN_SPLIT_LEN,  # keys per split at least (tests shrink it)
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,  # from alloc_scratch, else allocated
    window: int = 0,  # > 0: a query at position p sees keys p - window + 1 .. p only
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads] fp32: a logit per head in the softmax
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None,  # (int8/fp8 caches: kernels/kv_quant.py)
) -> torch.Tensor:
    """The variants as twins.paged_attention defines them; see the module docstring."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    assert num_heads % num_kv_heads == 0, "GQA needs num_heads % num_kv_heads == 0"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    quant = kv_quant.is_quantized(k_cache.dtype)
    assert k_cache.shape[3] == head_dim and (quant or k_cache.dtype == q.dtype), (
        "cache/q head_dim or dtype")
    assert v_cache.dtype == k_cache.dtype
    if quant:
        assert k_scale is not None and v_scale is not None, "a quantized cache needs its scales"
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3]
        assert k_scale.stride() == v_scale.stride() and k_scale.dtype == torch.float32
    assert block_size & (block_size - 1) == 0, "KV block size must be a power of two"
    assert q.stride(-1) == k_cache.stride(-1) == block_tables.stride(-1) == 1
    assert seq_lens.shape == (num_seqs,) and query_start_loc.shape == (num_seqs + 1,)
    assert window >= 0 and softcap >= 0.0, "window and softcap are >= 0 (0: off)"
    # fp32 only: the pointer's dtype is part of the compile the warm-up makes.
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.stride(0) == 1
                             and sinks.dtype == torch.float32), "sinks: one fp32 logit per q head"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    launches = plan_launches(q.dtype, num_heads, num_kv_heads, head_dim, num_tokens, num_seqs,
                             max_query_len)  # fmt: skip
    short = launches[0][0]
    if num_splits is None:
        num_warps = sum(n * config["num_warps"] for config, n in launches) * num_kv_heads
        num_splits = pick_max_splits(num_warps, q.device)
    split = num_splits > 1
    if split:
        partial, lse = scratch or alloc_scratch(num_tokens, num_heads, head_dim, num_splits,
                                                q.device)  # fmt: skip
        assert partial.shape[0] >= num_tokens and partial.shape[2] >= num_splits
        assert partial.shape[1:4:2] == (num_heads, head_dim) and partial.dtype == torch.float32
        partial, lse = partial[:num_tokens, :, :num_splits], lse[:num_tokens, :, :num_splits]
    else:
        partial, lse = out, out  # unused without splits
    for i, (config, num_blocks) in enumerate(launches):
        config = dict(config)
        num_warps = config.pop("num_warps")
        _paged_attention_kernel[(num_blocks, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, partial, lse,
            q if sinks is None else sinks,  # never read without sinks
            k_scale if quant else q, v_scale if quant else q,  # never read unquantized
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), *(k_scale.stride() if quant else (0, 0, 0)),
            out.stride(0), out.stride(1),
            *(partial.stride()[:3] if split else (0, 0, 0)), *(lse.stride()[:2] if split else (0, 0)),
            num_seqs, num_splits, min_split_len, int(window), scale * math.log2(math.e),
            float(softcap) * math.log2(math.e) if softcap else 1.0,
            KV_BLOCK_SIZE=block_size, SHORT_Q=short["BLOCK_Q"], LONG=i == 1, SPLIT=split,
            HAS_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None and not split, KV_QUANT=quant,
            num_warps=num_warps, num_stages=config["NUM_STAGES"], **config,
        )  # fmt: skip
    if split:
        merge_splits(partial, lse, out, sinks)
    return out
