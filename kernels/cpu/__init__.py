"""Fast CPU implementations of the kernels: the CPU backend at run time.

Same signatures and cache layout as the twins (kernels/twins.py), which stay the oracle. What
differs is how the work is batched, never what is computed:

- paged_attention: decode rows (one query token per sequence) of the whole batch in one call
  of the fused kernel (kernels/csrc/decode_attention.cpp, via kernels/cpu_ext.py), which reads each
  sequence's keys and values straight from its blocks; prefill rows (prompts, and chunks after
  a cached prefix) likewise in one call of the fused prefill kernel (prefill_attention.cpp:
  flash-style tiles of query positions times the KV head's group). Where that extension is
  unavailable, torch ops: every decode sequence's blocks gathered at once into ``[num_decode, max_ctx,
  ...]``, padded positions masked (-inf score, zeroed value so poison there cannot leak), one
  batched matmul/softmax/matmul per KV head; or, for a lone sequence or lengths far apart,
  SDPA sequence by sequence on unpadded keys. Prefill rows go through torch's fused SDPA per
  sequence (the flash CPU kernel), on the new keys directly when there is no cached prefix.
  The per-step bookkeeping (which rows decode, their block tables or gather index and mask) is
  an `AttentionPlan`, built once per step and shared by every layer.
  The variants (twins.paged_attention: sliding window, logit soft-capping, attention sinks) run
  on every path, per layer: the fused kernels take them as arguments; the torch paths gather
  from the block holding a sequence's first visible key (a window's gather index and mask are
  derived once per step and window, kept in the plan) and compute softcap and sinks with
  explicit matmuls and an fp32 softmax, which SDPA cannot. No path reads a key below a
  window, so a windowed decode costs the window, not the context, and blocks the block
  manager freed below a window may hold anything.
- rms_norm, silu_and_mul: the fused kernels for 16-bit dtypes (silu_and_mul bitwise equal to
  the twin, rms_norm within one rounding: its mean sums in another order); in fp32 torch's own
  ops, whose reduction order the twin and transformers share, so fp32 stays bitwise.
- rotary: the fused kernel (bitwise equal to the twin in every dtype); without it, q and k
  rotated in one pass of torch ops when k directly follows q in memory (the fused qkv layout).
- store_kv: one index_copy_ per cache into its flat slot view.

fp32 stays fp32 throughout, so fp32 greedy decoding stays token-exact against transformers.
16-bit inputs are computed in `compute_dtype(dtype)`: the model dtype where the CPU has native
bf16/fp16 matmuls, else fp32 (torch's emulated 16-bit matmul is several times slower than fp32
on CPUs without AVX512-BF16/AMX). Softmax is always accumulated in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import kv_quant, twins
from kernels.cpu.runtime import compute_dtype as compute_dtype
from kernels.cpu.runtime import fused_kernels as fused_kernels
from kernels.cpu.runtime import has_native_bf16 as has_native_bf16


@dataclass(frozen=True)
class WindowedDecode:
    """The torch decode path's operands for one sliding window: only the blocks holding some
    sequence's last `window` positions, per sequence from the block of its first visible one.

        block_ids  [num_decode * width] int64: each sequence's `width` blocks from that one
                   (past its last block: repeats of a table entry, masked)
        padding    [num_decode, 1, width * block_size] bool: outside the window or the length
        padding_v  the same, shaped [num_decode, width * block_size, 1, 1] for values
        per_seq    attend sequence by sequence, judged on the windowed lengths
    """

    block_ids: torch.Tensor
    padding: torch.Tensor
    padding_v: torch.Tensor
    per_seq: bool


@dataclass(frozen=True)
class AttentionPlan:
    """Which token rows decode and which prefill, for one step; shared by every layer.

    Decode part (sequences scheduled with exactly one token), in batch order::

        decode_rows      token rows of the decode sequences: a slice when they are contiguous
        decode_fused     attend with the fused kernel; then only the two fields below are set
                         of the decode part's tensors (the rest are empty)
        decode_tables    [num_decode, max_blocks] int32: their block tables
        decode_seq_lens  [num_decode] int32: their lengths
        decode_block_ids [num_decode * max_blocks] int64: their block tables, flattened
        decode_padding   [num_decode, 1, max_blocks * block_size] bool: position >= seq_len
        decode_padding_v the same, shaped [num_decode, max_blocks * block_size, 1, 1] for values
        decode_max_len   the longest decode sequence's length (host int)
        decode_lens      every decode sequence's length (host ints)
        decode_per_seq   attend sequence by sequence (`_decode_per_sequence`) rather than
                         over the padded batch: see `per_sequence_decode`

    Prefill part, per sequence with more than one token: (first row, end row, seq_len, its
    block ids, fresh) where fresh means no cached prefix: all its keys are this step's. With
    the fused kernels, `prefill_fused` and the step's own int32 tensors below instead: the
    kernel reads every prefill's keys from its blocks.

        prefill_seq_ids  [num_prefills] int32: the prefilling sequences' batch indices
        block_tables, query_start_loc, seq_lens: the step's, int32

    Nothing here depends on a layer's attention variant (window, softcap, sinks): the fused
    kernels take those per call. The torch decode path derives a window's gather index and
    mask from the fields above on first use and keeps them in `windows` (window -> a
    `WindowedDecode`), so layers sharing a window share them (Gemma alternates two).
    """

    num_decode: int
    decode_rows: slice | torch.Tensor
    decode_block_ids: torch.Tensor
    decode_padding: torch.Tensor
    decode_padding_v: torch.Tensor
    prefills: list[tuple[int, int, int, torch.Tensor, bool]]
    decode_max_len: int = 0
    decode_lens: tuple[int, ...] = ()
    decode_per_seq: bool = False
    decode_fused: bool = False
    decode_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    prefill_fused: bool = False
    prefill_seq_ids: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    windows: dict[int, WindowedDecode] = field(default_factory=dict, compare=False, repr=False)


# The padded batch computes max_len scores per decode sequence; one by one, each sequence costs
# a SDPA call and two gathers (~25 us on a 2-core Xeon) but reads no padding (~0.2 us per
# padded position there, all heads of a small model). Sequence by sequence wins once the
# longest sequence is this many positions longer than the mean (measured with SmolLM2's and
# Qwen2.5-0.5B's heads: batched 1.8x faster at 8 x 160 equal lengths, even at 8 x 600, per
# sequence 1.5x faster at 4 sequences of 50-1500 and 5x at 32).
PER_SEQ_SLACK = 128


def per_sequence_decode(lens: tuple[int, ...]) -> bool:
    """Whether a step's decode sequences (of these lengths) attend one by one: a lone one
    (no padding, no mask: SDPA's fused kernel), or lengths far apart."""
    return len(lens) == 1 or max(lens) - sum(lens) / len(lens) > PER_SEQ_SLACK


@functools.cache
def fused_vector_width() -> int:
    """The fused kernels' fp32 lanes (16 with AVX512, 8 with AVX2): the fused prefill kernel
    works on whole vectors of a head, so it takes head_dim a multiple of this."""
    return fused_kernels().vector_width()


def plan_attention(block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
                   seq_lens: torch.Tensor,  # [num_seqs] int32
                   query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
                   block_size: int) -> AttentionPlan:
    # One host read of the step's lengths; the loop is per sequence, once per step.
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode_seqs, prefill_seqs, prefills = [], [], []
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end - q_start == 1:
            decode_seqs.append(i)
        elif q_end > q_start:
            num_blocks = -(-seq_len // block_size)
            prefill_seqs.append(i)
            prefills.append((q_start, q_end, seq_len, block_tables[i, :num_blocks].long(),
                             seq_len == q_end - q_start))
    fused = fused_kernels() is not None
    step: dict = {}
    if fused and prefills:
        step = dict(prefill_fused=True,
                    prefill_seq_ids=torch.tensor(prefill_seqs, dtype=torch.int32),
                    block_tables=block_tables.int(), query_start_loc=query_start_loc.int(),
                    seq_lens=seq_lens.int())
    num_decode = len(decode_seqs)
    if num_decode == 0:
        empty = torch.empty(0)
        return AttentionPlan(0, slice(0, 0), empty.long(), empty, empty.bool(), prefills, **step)
    rows = [starts[i] for i in decode_seqs]
    if rows == list(range(rows[0], rows[0] + num_decode)):
        decode_rows: slice | torch.Tensor = slice(rows[0], rows[0] + num_decode)
    else:
        decode_rows = torch.tensor(rows, dtype=torch.long)
    max_len = max(lens[i] for i in decode_seqs)
    decode_lens = tuple(lens[i] for i in decode_seqs)
    if fused:
        empty = torch.empty(0)
        if num_decode == len(lens):  # every sequence decodes: the batch's own tensors
            tables, dec_lens = block_tables, seq_lens
        else:
            seq_idx = torch.tensor(decode_seqs, dtype=torch.long)
            tables, dec_lens = block_tables[seq_idx], seq_lens[seq_idx]
        return AttentionPlan(num_decode, decode_rows, empty.long(), empty, empty.bool(),
                             prefills, max_len, decode_lens, decode_fused=True,
                             decode_tables=tables.int(), decode_seq_lens=dec_lens.int(), **step)
    max_blocks = -(-max_len // block_size)
    seq_idx = torch.tensor(decode_seqs, dtype=torch.long)
    block_ids = block_tables[seq_idx, :max_blocks].long().flatten()
    positions = torch.arange(max_blocks * block_size)  # [max_ctx]
    padding = positions[None, :] >= seq_lens[seq_idx, None]  # [num_decode, max_ctx]
    return AttentionPlan(num_decode, decode_rows, block_ids, padding[:, None, :],
                         padding[:, :, None, None], prefills, max_len, decode_lens,
                         per_sequence_decode(decode_lens))


def paged_attention_planned(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim], this step's keys
    value: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    window: int = 0,  # > 0: a query at position p sees keys p - window + 1 .. p only
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head in the softmax
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None,  # (quantized caches: kernels/kv_quant.py)
) -> torch.Tensor:
    """Attention for a step whose keys/values are already in the cache. `key`/`value` are
    optional: with them a prefill without cached prefix skips the gather from the cache
    (not with a quantized cache: the attention reads what the cache holds, as the twin does).
    The variants are twins.paged_attention's; keys below a query's window are never read."""
    assert window >= 0 and softcap >= 0.0, "window and softcap are >= 0 (0: off)"
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    if sinks is not None:
        sinks = sinks.float().contiguous()
    quantized = k_scale is not None
    if quantized:
        key = value = None
    variant = dict(window=window, softcap=softcap, sinks=sinks)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if plan.decode_fused:
        ops = fused_kernels()
        if isinstance(plan.decode_rows, slice):  # written in place, through a strided view
            ops.decode_attention(out[plan.decode_rows], q[plan.decode_rows], k_cache, v_cache,
                                 plan.decode_tables, plan.decode_seq_lens, scale, **variant,
                                 **scales)
        else:
            dec_out = torch.empty((plan.num_decode, *q.shape[1:]), dtype=q.dtype)
            ops.decode_attention(dec_out, q[plan.decode_rows], k_cache, v_cache,
                                 plan.decode_tables, plan.decode_seq_lens, scale, **variant,
                                 **scales)
            out[plan.decode_rows] = dec_out
    elif plan.num_decode:
        out[plan.decode_rows] = _decode(q[plan.decode_rows], k_cache, v_cache, plan, scale,
                                        **variant, **scales)
    if plan.prefill_fused and q.shape[2] % fused_vector_width() == 0:
        fused_kernels().prefill_attention(out, q, k_cache, v_cache, plan.block_tables,
                                          plan.query_start_loc, plan.seq_lens,
                                          plan.prefill_seq_ids, scale, **variant, **scales)
        return out
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    cdt = compute_dtype(q.dtype)
    for q_start, q_end, seq_len, block_ids, fresh in plan.prefills:
        q_len = q_end - q_start
        qi = q[q_start:q_end].transpose(0, 1).to(cdt)  # [num_heads, q_len, head_dim]
        direct = fresh and key is not None and value is not None
        if direct:
            ki, vi = key[q_start:q_end], value[q_start:q_end]  # [q_len, num_kv_heads, head_dim]
            lo = 0
        else:
            # Whole blocks from the one holding the first query's first visible key (every
            # block without a window), flattened to positions lo.., trimmed to seq_len.
            first = max(0, seq_len - q_len - window + 1) // block_size if window else 0
            lo = first * block_size
            ki = _gather(k_cache, k_scale, block_ids[first:], cdt)[:seq_len - lo]  # [n, H, D]
            vi = _gather(v_cache, v_scale, block_ids[first:], cdt)[:seq_len - lo]
        ki, vi = ki.transpose(0, 1).to(cdt), vi.transpose(0, 1).to(cdt)  # [kv_heads, n, D]
        explicit = softcap or sinks is not None  # score variants SDPA lacks
        # A fresh prompt's own keys, plain: SDPA's causal flag, no mask.
        mask = (None if direct and not window and not explicit
                else _visible_keys(seq_len, q_len, window, lo))  # [q_len, seq_len - lo]
        if explicit:
            o = _attend(qi, ki, vi, scale, softcap, sinks, mask)  # [num_heads, q_len, D]
        else:
            # 4-D inputs: with 3-D ones SDPA falls back to its unfused math path on the CPU.
            o = F.scaled_dot_product_attention(
                qi[None], ki[None], vi[None], attn_mask=mask, is_causal=mask is None,
                scale=scale, enable_gqa=num_heads != num_kv_heads,
            )[0]  # [num_heads, q_len, head_dim]
        out[q_start:q_end] = o.transpose(0, 1)
    return out


def _gather(cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
            scale: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads] fp32
            block_ids: torch.Tensor,  # [n] int64
            cdt: torch.dtype) -> torch.Tensor:  # [n * block_size, num_kv_heads, head_dim]
    """The blocks' rows flattened to positions: as stored, or dequantized to `cdt` (in fp32,
    rounded once) for a quantized cache."""
    rows = cache.index_select(0, block_ids).flatten(0, 1)
    if scale is None:
        return rows
    return kv_quant.dequantize(rows, scale.index_select(0, block_ids).flatten(0, 1), cdt)


def _visible_keys(seq_len: int, q_len: int, window: int, lo: int) -> torch.Tensor:
    """[q_len, seq_len - lo] bool: query j (at position seq_len - q_len + j) sees the key at
    position lo + i: at or before it, and within `window` of it if > 0."""
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    key_pos = torch.arange(lo, seq_len)[None, :]
    mask = key_pos <= query_pos
    if window:
        mask &= key_pos > query_pos - window
    return mask


def _attend(q: torch.Tensor,  # [num_heads, q_len, head_dim], compute dtype
            k: torch.Tensor,  # [num_kv_heads, n, head_dim]
            v: torch.Tensor,  # [num_kv_heads, n, head_dim]
            scale: float, softcap: float, sinks: torch.Tensor | None,  # [num_heads] fp32
            mask: torch.Tensor | None,  # [q_len, n] bool, True: visible; None: all visible
            ) -> torch.Tensor:  # [num_heads, q_len, head_dim], compute dtype
    """Attention with the score variants SDPA lacks: explicit matmuls, a softmax in fp32.
    Each KV head's group of query heads is one [group * q_len, D] matrix, so K and V are
    never repeated per head."""
    num_heads, q_len, head_dim = q.shape
    num_kv_heads, n, _ = k.shape
    group = num_heads // num_kv_heads
    qg = q.reshape(num_kv_heads, group * q_len, head_dim)
    scores = torch.bmm(qg, k.transpose(1, 2)).float().mul_(scale)  # [kv_heads, group*q_len, n]
    if softcap:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.view(num_kv_heads, group, q_len, n)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.view(num_kv_heads, group, 1, 1).expand(num_kv_heads, group, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.to(q.dtype).reshape(num_kv_heads, group * q_len, n)
    return torch.bmm(probs, v).view(num_heads, q_len, head_dim)


def _windowed(plan: AttentionPlan, window: int, block_size: int) -> WindowedDecode:
    """The plan's decode operands for `window`, built on first use in a step (host ints and a
    few small tensor ops) and kept in the plan for the step's other layers."""
    found = plan.windows.get(window)
    if found is not None:
        return found
    lens = plan.decode_lens
    firsts = [max(0, n - window) // block_size for n in lens]
    width = max(-(-n // block_size) - f for n, f in zip(lens, firsts, strict=True))
    max_blocks = plan.decode_block_ids.numel() // plan.num_decode
    first = torch.tensor(firsts)[:, None]  # [num_decode, 1]
    # A column past a sequence's last block repeats a table entry; its positions are masked.
    cols = (first + torch.arange(width)).clamp_(max=max_blocks - 1)  # [num_decode, width]
    block_ids = plan.decode_block_ids.view(plan.num_decode, max_blocks).gather(1, cols)
    positions = first * block_size + torch.arange(width * block_size)  # [num_decode, ctx]
    seq_lens = torch.tensor(lens)[:, None]
    padding = (positions >= seq_lens) | (positions < seq_lens - window)
    found = WindowedDecode(block_ids.flatten(), padding[:, None, :], padding[:, :, None, None],
                           per_sequence_decode(tuple(min(n, window) for n in lens)))
    plan.windows[window] = found
    return found


def _decode(q: torch.Tensor,  # [num_decode, num_heads, head_dim]
            k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
            scale: float, *, window: int = 0, softcap: float = 0.0,
            sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor:  # [num_decode, num_heads, D]
    num_decode, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    cdt = compute_dtype(q.dtype)
    block_ids, padding, padding_v, per_seq = (plan.decode_block_ids, plan.decode_padding,
                                              plan.decode_padding_v, plan.decode_per_seq)
    if window:
        w = _windowed(plan, window, k_cache.shape[1])
        block_ids, padding, padding_v, per_seq = w.block_ids, w.padding, w.padding_v, w.per_seq
    if per_seq:
        return _decode_per_sequence(q, k_cache, v_cache, plan, scale, window, softcap, sinks,
                                    k_scale, v_scale)
    # Whole blocks of every decode sequence, all KV heads: [num_decode, ctx, kv_heads, D].
    k = _gather(k_cache, k_scale, block_ids, cdt).view(num_decode, -1, num_kv_heads, head_dim)
    v = _gather(v_cache, v_scale, block_ids, cdt).view(num_decode, -1, num_kv_heads, head_dim)
    k, v = k.to(cdt), v.to(cdt)
    # Padded positions get probability exactly 0; zeroing their values keeps 0 * NaN (stale
    # or poisoned slots) out of the sum.
    v.masked_fill_(padding_v, 0.0)
    qc = q.to(cdt)
    out = torch.empty((num_decode, num_heads, head_dim), dtype=cdt)
    for h in range(num_kv_heads):
        heads = slice(h * group, (h + 1) * group)
        # Strided views: [num_decode, group, D] @ [num_decode, D, ctx], no copies.
        scores = torch.bmm(qc[:, heads], k[:, :, h].transpose(1, 2))  # [num_decode, group, ctx]
        scores = scores.float().mul_(scale)
        if softcap:
            scores.div_(softcap).tanh_().mul_(softcap)
        # Padded keys may hold anything, NaN included: their scores are replaced, not added to.
        scores.masked_fill_(padding, float("-inf"))
        if sinks is not None:
            sink = sinks[heads].view(1, group, 1).expand(num_decode, group, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[:, heads] = torch.bmm(probs.to(cdt), v[:, :, h])  # [num_decode, group, D]
    return out.to(q.dtype)


def _decode_per_sequence(q: torch.Tensor,  # [num_decode, num_heads, head_dim]
                         k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
                         scale: float, window: int = 0, softcap: float = 0.0,
                         sinks: torch.Tensor | None = None,
                         k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None,
                         ) -> torch.Tensor:  # [num_decode, num_heads, head_dim]
    """Each decode sequence on its own: its keys trimmed to its window and length need no
    mask, and SDPA's fused kernel reads no padding (explicit matmuls for softcap, sinks)."""
    num_decode, num_heads, _ = q.shape
    cdt = compute_dtype(q.dtype)
    gqa = num_heads != k_cache.shape[2]
    max_blocks = plan.decode_block_ids.numel() // num_decode
    block_size = k_cache.shape[1]
    qc = q.to(cdt)[:, :, None, :]  # [num_decode, num_heads, 1, head_dim]
    out = torch.empty(q.shape, dtype=cdt)
    for i, seq_len in enumerate(plan.decode_lens):
        lo = max(0, seq_len - window) if window else 0  # the first visible position
        first = lo // block_size
        start = i * max_blocks
        block_ids = plan.decode_block_ids[start + first:start + -(-seq_len // block_size)]
        trim = slice(lo - first * block_size, seq_len - first * block_size)
        k1 = _gather(k_cache, k_scale, block_ids, cdt)[trim]  # [n, kv_heads, D]
        v1 = _gather(v_cache, v_scale, block_ids, cdt)[trim]
        k1, v1 = k1.transpose(0, 1).to(cdt), v1.transpose(0, 1).to(cdt)  # [kv_heads, n, D]
        if softcap or sinks is not None:
            out[i] = _attend(qc[i], k1, v1, scale, softcap, sinks, None)[:, 0]
        else:
            out[i] = F.scaled_dot_product_attention(  # [1, num_heads, 1, head_dim]
                qc[i:i + 1], k1[None], v1[None], scale=scale, enable_gqa=gqa)[0, :, 0]
    return out.to(q.dtype)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin's signature: plans the step, then attends (keys read from the cache)."""
    plan = plan_attention(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    return paged_attention_planned(q, None, None, k_cache, v_cache, plan, scale, out,
                                   window=window, softcap=softcap, sinks=sinks,
                                   k_scale=k_scale, v_scale=v_scale)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding, skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None,
) -> None:
    if kv_quant.is_quantized(k_cache.dtype) or not (k_cache.is_contiguous()
                                                    and v_cache.is_contiguous()):
        # The quantizing store is the twin's: one definition of the codes (kv_quant.py).
        twins.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    # A contiguous cache viewed flat: row `slot` is block slot // block_size, offset the rest.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    ops = fused_kernels()
    if ops is not None and x.dtype != torch.float32 and weight.dtype == x.dtype:
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden)  # a view where the layout allows, else a copy
        res = residual.reshape(-1, hidden) if residual is not None else None
        outs = ops.rms_norm(rows, weight.contiguous(), eps, res)
        if residual is None:
            return outs[0].view(x.shape)
        return outs[0].view(x.shape), outs[1].view(x.shape)
    if residual is not None:
        x = x + residual  # the residual stream, summed in the model dtype as transformers does
    out = torch.rms_norm(x, weight.shape, weight, eps)
    return out if residual is None else (out, x)


def rotary(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos | sin halves
) -> None:
    ops = fused_kernels()
    if (ops is not None and cos_sin_cache.dtype == torch.float32 and q.dtype == k.dtype
            and positions.dtype == torch.long and positions.is_contiguous()
            and q.stride(-1) == k.stride(-1) == cos_sin_cache.stride(-1) == 1):
        ops.rotary(positions, q, k, cos_sin_cache)
        return
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)  # [num_tokens, head_dim]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]  # [num_tokens, 1, half]
    for x in _rotary_operands(q, k):
        x1, x2 = x[..., :half], x[..., half:]
        # Neox style, the twin's arithmetic: (x1*cos - x2*sin, x2*cos + x1*sin).
        y1 = x1 * cos
        y1 -= x2 * sin
        y2 = x2 * cos
        y2 += x1 * sin
        x1.copy_(y1)
        x2.copy_(y2)


def _rotary_operands(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q and k as one [num_tokens, num_heads + num_kv_heads, head_dim] view,) when k's heads
    follow q's in every row (the fused qkv output), else (q, k)."""
    num_tokens, num_heads, head_dim = q.shape
    if (q.dtype == k.dtype and q.stride(2) == 1 and q.stride(1) == head_dim
            and k.stride() == q.stride() and k.shape[0] == num_tokens
            and k.data_ptr() == q.data_ptr() + num_heads * head_dim * q.element_size()):
        return (q.as_strided((num_tokens, num_heads + k.shape[1], head_dim), q.stride()),)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * intermediate]
    ops = fused_kernels()
    if ops is not None and x.dtype != torch.float32:
        out = ops.silu_and_mul(x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], x.shape[-1] // 2)
    intermediate = x.shape[-1] // 2
    out = F.silu(x[..., :intermediate])  # [num_tokens, intermediate]
    return out.mul_(x[..., intermediate:])


# 8-bit weights: the twin is the CPU backend (slices of rows dequantized into fp32 products).
w8a16_linear = twins.w8a16_linear
group_quant_linear = twins.group_quant_linear


# The mixture-of-experts MLP on packed experts (kernels/cpu/moe.py); after the names it uses.
from kernels.cpu.moe import PackedExperts as PackedExperts  # noqa: E402
from kernels.cpu.moe import fused_moe as fused_moe  # noqa: E402
from kernels.cpu.moe import fused_moe_packed as fused_moe_packed  # noqa: E402
from kernels.cpu.moe import pack_moe_weights as pack_moe_weights  # noqa: E402
