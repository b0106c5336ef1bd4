"""paged_attention: causal attention of a varlen query batch over the paged KV cache (Triton).

One kernel covers decode, prefill and chunked prefill. A program owns one tile of query rows of
one sequence and one KV head; the rows are (token, q head) pairs, so every q head sharing the KV
head reads each K/V tile once (GQA packing):

    rows of a tile, GROUP_PAD = 4:   row r -> token r // 4, head kv_head * group + r % 4
    r:  0  1  2  3 | 4  5  6  7 | ...
        t0 t0 t0 t0 | t1 t1 t1 t1 | ...

Query token j of a sequence sits at position seq_len - q_len + j and sees keys 0..its position:
full attention to the cached prefix, causal over the new tokens. Key tiles that every query of
the tile sees run without the mask; only the tail tiles pay for it.

Split-KV: when (query tiles x KV heads) cannot fill the GPU (few sequences, long context), the key
range is cut into num_splits chunks; each program writes a normalized partial output and its
log-sum-exp (base 2), and a second kernel merges them.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from kernels.attention_reduce import merge_splits

_MIN_SPLIT_LEN = 256  # shorter splits cost more in the merge than they win in parallelism


@triton.jit
def _attend(
    acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, head_off,
    stride_cache_b, stride_cache_s, lo, hi, scale_log2e,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        kv_pos = start + offs_n  # [BLOCK_N]
        kv_valid = kv_pos < hi
        # Gather through the block table: each key's physical block, then its row in it.
        block_ids = tl.load(block_table_ptr + kv_pos // KV_BLOCK_SIZE, mask=kv_valid, other=0)
        kv_off = block_ids.to(tl.int64) * stride_cache_b + (kv_pos % KV_BLOCK_SIZE) * stride_cache_s
        kv_off += head_off
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + offs_d[:, None],
            mask=kv_valid[None, :] & d_mask[:, None],
            other=0.0,
        )  # [HEAD_DIM_PAD, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no visible key yet keep m = -inf; shift them by 0, not by -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + offs_d[None, :],
            mask=kv_valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, lse_ptr,
    stride_q_t, stride_q_h, stride_cache_b, stride_cache_s, stride_cache_h, stride_bt,
    stride_out_t, stride_out_h, stride_out_s, stride_lse_t, stride_lse_h,
    num_splits, split_len, scale_log2e,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # Heaviest tiles (last queries, longest causal range) first: the GPU starts blocks in
    # launch order, so the long ones do not trail at the end of the grid.
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
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
    q = tl.load(
        q_ptr + token_ids[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    # Keys this tile needs: up to its last query; this split's share of them.
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    lo = split * split_len
    hi = tl.minimum(kv_end, lo + split_len)
    if split == num_splits - 1:
        hi = kv_end  # the last split takes any remainder, whatever max_seq_len claimed
    # Whole key tiles below the first query's position are visible to every row: no mask.
    mid = tl.minimum((hi // BLOCK_N) * BLOCK_N, ((first_pos + 1) // BLOCK_N) * BLOCK_N)
    mid = tl.maximum(mid, lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_cache_h
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, head_off,
        stride_cache_b, stride_cache_s, lo, mid, scale_log2e,
        False, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, head_off,
        stride_cache_b, stride_cache_s, mid, hi, scale_log2e,
        True, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE, DOT_PRECISION,
    )  # fmt: skip

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_off = token_ids[:, None] * stride_out_t + head[:, None] * stride_out_h + offs_d[None, :]
    if SPLIT:
        tl.store(out_ptr + out_off + split * stride_out_s, o, mask=io_mask)
        # Rows with no visible key in this split weigh nothing in the merge.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.maximum(l_i, 1e-30)))
        lse_off = token_ids * stride_lse_t + head * stride_lse_h + split
        tl.store(lse_ptr + lse_off, lse, mask=row_valid)
    else:
        tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=io_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no parallelism to fill, never split unless asked
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pick_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    target = 4 * _num_sms(device)  # a few resident programs per SM to hide memory latency
    if num_programs >= target or max_seq_len < 2 * _MIN_SPLIT_LEN:
        return 1
    return max(1, min(triton.cdiv(target, num_programs), max_seq_len // _MIN_SPLIT_LEN, 64))


def launch_config(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int
) -> dict:
    """Tile sizes and launch options (shared with the sm_90 compile test)."""
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    fp32 = dtype == torch.float32
    # 16 rows is tl.dot's floor: decode-like batches pad to it; prefill tiles take 128 rows.
    # fp32 is a correctness path on GPUs (exact dots run on FMA units, not tensor cores): small
    # tiles over 8 warps keep its register spills small.
    max_rows = 32 if fp32 else 128
    rows = group_pad * triton.next_power_of_2(max(max_query_len, 1))
    block_m = max(16, min(max_rows, rows), group_pad)
    return dict(
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m,
        BLOCK_N=32 if fp32 else 64,  # fp32 key tiles take twice the shared memory
        BLOCK_Q=block_m // group_pad, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if fp32 else "tf32",  # fp32 stays exact; ignored for 16-bit
        num_warps=8 if block_m >= 128 or fp32 else 4, num_stages=2 if fp32 else 3,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,  # sizes the grid: must be >= every query length
    max_seq_len: int,  # only a hint for the split heuristic
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    num_splits: int | None = None,  # None = heuristic; tests force the split path with it
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    assert num_heads % num_kv_heads == 0, "GQA needs num_heads % num_kv_heads == 0"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[3] == head_dim and k_cache.dtype == q.dtype, "cache/q head_dim or dtype"
    assert q.stride(-1) == k_cache.stride(-1) == block_tables.stride(-1) == 1
    assert seq_lens.shape == (num_seqs,) and query_start_loc.shape == (num_seqs + 1,)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    config = launch_config(q.dtype, num_heads, num_kv_heads, head_dim, max_query_len)
    block_n = config["BLOCK_N"]
    num_q_tiles = triton.cdiv(max(max_query_len, 1), config["BLOCK_Q"])
    if num_splits is None:
        num_splits = _pick_num_splits(num_q_tiles * num_seqs * num_kv_heads, max_seq_len, q.device)
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n

    if num_splits > 1:
        target = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        out_strides = (target.stride(0), target.stride(1), target.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    else:
        target, lse = out, out  # lse is unused without splits
        out_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)

    grid = (num_q_tiles, num_seqs, num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, target, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), *out_strides, *lse_strides,
        num_splits, split_len, scale * math.log2(math.e),
        KV_BLOCK_SIZE=block_size, SPLIT=num_splits > 1, **config,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(target, lse, out)
    return out
