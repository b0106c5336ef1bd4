"""Torch twins of the Triton kernels: the oracle in tests and the CPU backend at run time.

Every function here has exactly the signature of its Triton launcher (see kernels/__init__.py
for the public dispatch). The math follows HF transformers' Llama modules operation by
operation, so a fp32 CPU run is token-exact against transformers' greedy decoding:

- rms_norm: square/mean/rsqrt in fp32, cast back, then `weight * normed` in the input dtype.
- rotary: `q * cos + rotate_half(q) * sin` in the input dtype, with cos/sin cast to it first.
- attention: torch SDPA on the gathered context for prefill (what transformers runs on CPU),
  two matmuls and a softmax for decode rows; fp32 math for 16-bit inputs so the twin stays a
  sharp oracle.

Cache layout: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim] and a slot is
block_id * block_size + offset. A quantized cache (fp8, int8) comes with fp32 scales
[num_blocks, block_size, num_kv_heads] per cache; kernels/kv_quant.py defines them.
"""

import torch
import torch.nn.functional as F

from kernels import kv_quant


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding, skip
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None,  # (quantized caches only: kernels/kv_quant.py)
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[valid]
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - block_ids * block_size
    # Index with (block, offset) pairs rather than a flat view so non-contiguous caches work.
    if not kv_quant.is_quantized(k_cache.dtype):
        k_cache[block_ids, offsets] = key[valid].to(k_cache.dtype)
        v_cache[block_ids, offsets] = value[valid].to(v_cache.dtype)
        return
    assert k_scale is not None and v_scale is not None, "a quantized cache needs its scales"
    dynamic = kv_quant.dynamic_scales(k_cache.dtype)
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        codes, row_scale = kv_quant.quantize_rows(
            x[valid], cache.dtype, None if dynamic else scale[block_ids, offsets])
        cache[block_ids, offsets] = codes
        if dynamic:
            scale[block_ids, offsets] = row_scale


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    window: int = 0,  # > 0: a query at position p sees keys p - window + 1 .. p only
    softcap: float = 0.0,  # > 0: scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads] fp32: a logit per head in the softmax
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] fp32
    v_scale: torch.Tensor | None = None,  # (quantized caches: value = code * scale)
) -> torch.Tensor:
    """The attention variants, as the models' HF code defines them (scores in natural-log
    units, after `scale`):

        s = scale * q.k;  s = softcap * tanh(s / softcap)         (softcap > 0)
        visible(p, j) = j <= p and (window == 0 or j > p - window)
        out = sum_j softmax([s_j for visible j] + [sink_h])_j * v_j  (the sink's weight dropped)

    Keys below the window of a sequence's first query are never read (their blocks may have
    been freed and reused: the block manager frees what left every window)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "GQA needs num_heads % num_kv_heads == 0"
    assert window >= 0 and softcap >= 0.0, "window and softcap are >= 0 (0: off)"
    assert sinks is None or sinks.shape == (num_heads,), "sinks: one logit per q head"
    if out is None:
        out = torch.empty_like(q)
    compute_dtype = torch.float32
    plain = window == 0 and softcap == 0.0 and sinks is None
    # One host transfer for the whole batch; the loop below is per sequence, never per token.
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        # Keys from the first block any query of the sequence sees.
        first_block = max(0, seq_len - q_len - window + 1) // block_size if window else 0
        lo = first_block * block_size
        num_seq_blocks = -(-seq_len // block_size)
        block_ids = block_tables[i, first_block:num_seq_blocks].long()
        # Gather whole blocks, flatten to positions, trim the tail of the last block.
        k = k_cache[block_ids].flatten(0, 1)[:seq_len - lo]  # [seq_len - lo, kv_heads, D]
        v = v_cache[block_ids].flatten(0, 1)[:seq_len - lo]
        if k_scale is not None and v_scale is not None:  # dequantized in fp32
            k = kv_quant.dequantize(k, k_scale[block_ids].flatten(0, 1)[:seq_len - lo])
            v = kv_quant.dequantize(v, v_scale[block_ids].flatten(0, 1)[:seq_len - lo])
        qi = q[q_start:q_end].transpose(0, 1).to(compute_dtype)  # [num_heads, q_len, head_dim]
        k = k.transpose(0, 1).to(compute_dtype)  # [num_kv_heads, seq_len, head_dim]
        v = v.transpose(0, 1).to(compute_dtype)  # [num_kv_heads, seq_len, head_dim]
        if not plain:
            o = _attention_variant(qi, k, v, seq_len, lo, scale, window, softcap, sinks)
        elif q_len == 1:
            # Decode: one query row sees the whole context. Two small matmuls per KV head beat
            # SDPA's CPU dispatch several times over at this size.
            qg = qi.view(num_kv_heads, num_heads // num_kv_heads, head_dim)  # [Hkv, group, D]
            probs = torch.softmax((qg @ k.transpose(1, 2)) * scale, dim=-1)  # [Hkv, group, seq_len]
            o = (probs @ v).view(num_heads, 1, head_dim)
        else:
            o = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=visible_keys(seq_len, q_len, 0, q.device), scale=scale,
                enable_gqa=num_heads != num_kv_heads
            )  # [num_heads, q_len, head_dim]
        out[q_start:q_end] = o.transpose(0, 1).to(out.dtype)
    return out


def visible_keys(seq_len: int, q_len: int, window: int,
                 device: torch.device | str = "cpu", lo: int = 0) -> torch.Tensor:
    """[q_len, seq_len - lo] bool: query j (at position seq_len - q_len + j) sees the key at
    position lo + i. Full attention to the cached prefix, causal over the new tokens, within
    `window` if > 0."""
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(lo, seq_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if window:
        mask &= key_pos > query_pos - window
    return mask


def _attention_variant(q: torch.Tensor,  # [num_heads, q_len, head_dim] fp32
                       k: torch.Tensor,  # [num_kv_heads, seq_len - lo, head_dim] fp32
                       v: torch.Tensor,  # [num_kv_heads, seq_len - lo, head_dim] fp32
                       seq_len: int, lo: int, scale: float, window: int, softcap: float,
                       sinks: torch.Tensor | None) -> torch.Tensor:  # [num_heads, q_len, D]
    num_heads, q_len, _ = q.shape
    group = num_heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # [num_heads, seq_len, head_dim]
    v = v.repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(1, 2)) * scale  # [num_heads, q_len, seq_len - lo]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible_keys(seq_len, q_len, window, q.device, lo),
                               float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype)[:, None, None].expand(num_heads, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs @ v


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        # The residual stream is summed in the model dtype, as transformers does.
        x = x + residual
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)


def rotary(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos | sin halves
) -> None:
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions]  # [num_tokens, head_dim]
    cos = cos_sin[:, None, :half]  # [num_tokens, 1, half]
    sin = cos_sin[:, None, half:]  # [num_tokens, 1, half]
    for x in (q, k):
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        # Neox style: (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin), rotating halves.
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        x.copy_(rotated)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * intermediate]
    intermediate = x.shape[-1] // 2
    return F.silu(x[..., :intermediate]) * x[..., intermediate:]  # [num_tokens, intermediate]


MOE_ACTIVATIONS = ("silu", "swigluoai")


def moe_activation(gate_up: torch.Tensor, activation: str, limit: float,
                   alpha: float) -> torch.Tensor:  # [n, 2 * I] -> [n, I]
    """The experts' gated activation on [gate | up] halves: "silu" (SwiGLU: silu(gate) * up,
    Mixtral, Qwen-MoE) or "swigluoai" (gpt-oss: both clamped at `limit` (gate from above, up
    on both sides), then (up + 1) * gate * sigmoid(alpha * gate))."""
    intermediate = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :intermediate], gate_up[..., intermediate:]
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32: each chosen expert's weight
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int: the chosen experts
    *,
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    activation: str = "silu",
    swiglu_limit: float = 7.0,  # swigluoai only
    swiglu_alpha: float = 1.702,  # swigluoai only
) -> torch.Tensor:  # [num_tokens, hidden] in x's dtype
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), an expert being
    w2 @ act(w13 @ x + b13) + b2. Each expert runs once, on the tokens routed to it, in fp32."""
    assert activation in MOE_ACTIVATIONS, f"activation is one of {MOE_ACTIVATIONS}"
    num_tokens, hidden = x.shape
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    xf = x.float()
    flat_ids = topk_ids.reshape(-1).long()
    for expert in flat_ids.unique().tolist():
        rows, slots = (topk_ids.long() == expert).nonzero(as_tuple=True)  # [n] each
        h = xf[rows] @ w13[expert].float().t()  # [n, 2 * intermediate]
        if w13_bias is not None:
            h = h + w13_bias[expert].float()
        h = moe_activation(h, activation, swiglu_limit, swiglu_alpha) @ w2[expert].float().t()
        if w2_bias is not None:
            h = h + w2_bias[expert].float()
        out.index_add_(0, rows, h * topk_weights[rows, slots].float()[:, None])
    return out.to(x.dtype)


# Weight elements dequantized at a time by w8a16_linear: 2 MiB of fp32, cache-sized, so no
# full dequantized copy of a weight ever exists.
DEQUANT_CHUNK_ELEMS = 1 << 19


def w8a16_linear(
    x: torch.Tensor,  # [num_tokens, in_features] fp16/bf16/fp32
    weight: torch.Tensor,  # [out_features, in_features] int8 or float8_e4m3fn
    scale: torch.Tensor,  # [out_features] fp32, per output channel
    bias: torch.Tensor | None,  # [out_features]
) -> torch.Tensor:  # [num_tokens, out_features] in x's dtype
    """x @ (scale[:, None] * weight)^T + bias in fp32, dequantizing one cache-sized slice of
    output rows at a time. The dequantized slice is exactly ``weight.float() * scale``, the
    matrix a float reference model would hold."""
    out_features, in_features = weight.shape
    rows = max(1, DEQUANT_CHUNK_ELEMS // max(1, in_features))
    xf = x.float()
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32, device=x.device)
    for start in range(0, out_features, rows):
        end = min(start + rows, out_features)
        w = weight[start:end].float() * scale[start:end, None]  # [end - start, in_features]
        out[:, start:end] = xf @ w.t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def group_quant_linear(
    x: torch.Tensor,  # [num_tokens, in_features] fp16/bf16/fp32
    qweight: torch.Tensor,  # uint8 [N, ceil(K / 2)] two 4-bit values a byte, or int8 [N, K]
    scales: torch.Tensor,  # [N, G] fp32
    offsets: torch.Tensor | None,  # [N, G] fp32
    g_idx: torch.Tensor | None,  # [K] int32 group of each input column; None: k // group_size
    group_size: int,
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [num_tokens, N] in x's dtype
    """x @ W^T + bias with W[n, k] = q[n, k] * scales[n, g(k)] + offsets[n, g(k)] in fp32
    (executor_svc/quantization/grouped.py), dequantizing one cache-sized slice of output rows
    at a time; 4-bit values sit in the low (even k) and high (odd k) nibble of each byte."""
    in_features = x.shape[1]
    out_features = qweight.shape[0]
    groups = (g_idx.long() if g_idx is not None
              else torch.arange(in_features, device=x.device) // group_size)
    rows = max(1, DEQUANT_CHUNK_ELEMS // max(1, in_features))
    xf = x.float()
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32, device=x.device)
    for start in range(0, out_features, rows):
        end = min(start + rows, out_features)
        q = qweight[start:end]
        if q.dtype == torch.uint8:
            q = torch.stack([q & 0xF, q >> 4], dim=2).reshape(end - start, -1)[:, :in_features]
        w = q.float() * scales[start:end][:, groups]
        if offsets is not None:
            w = w + offsets[start:end][:, groups]
        out[:, start:end] = xf @ w.t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
