"""fused_moe: the mixture-of-experts MLP as two grouped GEMMs (Triton).

out[t] = sum_s w[t, s] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]), e = ids[t, s]; the torch
twin (kernels/twins.py fused_moe) is the oracle.

1. Align (torch ops on the device, no host sync, so a CUDA graph can hold it): the T * k (token, slot) pairs are sorted by
   expert (stable) and laid out in BLOCK_M-row blocks, each expert's run padded to whole
   blocks with the sentinel T * k; `block_expert` names each block's expert (num_experts past
   the last used block: those programs exit). The number of blocks is bounded without reading
   the counts: ceil(P / BLOCK_M) + min(E, P).
2. `_moe_gate_up_kernel`: per (block, tile of intermediate features) the gate and up tiles of
   x[tokens] @ w13[e]^T in fp32, bias, the activation (SwiGLU or gpt-oss's clamped one) in the
   epilogue; act [blocks * BLOCK_M, I] in x's dtype, by padded row.
3. `_moe_down_kernel`: per (block, tile of hidden features) act @ w2[e]^T, bias, times the
   pair's routing weight; stored fp32 at the pair's own row of y [T * k, hidden].
4. The sum over a token's k slots, slot by slot (elementwise adds, no atomics), cast to x's
   dtype. BLOCK_M and the tiles do not depend on T and every row of a
   tile is computed on its own, so a token's output does not depend on the other tokens.

Shapes: x [T, hidden] (unit column stride), w13 [E, 2I, hidden], w2 [E, hidden, I] (unit
column strides), biases [E, 2I] / [E, hidden], topk_weights [T, k] fp32, topk_ids [T, k].
"""

import torch
import triton
import triton.language as tl

from kernels import twins

BLOCK_M = 16  # pairs per block: tl.dot's smallest M


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(x_ptr, w_ptr, bias_ptr, act_ptr, sorted_ptr, block_expert_ptr,
                        num_pairs, num_experts, top_k, HIDDEN, INTER,
                        stride_xm, stride_we, stride_wn, stride_be, stride_am,
                        limit, alpha,
                        OAI: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:  # past the last used block
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    valid = pairs < num_pairs
    tokens = tl.where(valid, pairs // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate_cols = w_base + offs_n.to(tl.int64)[None, :] * stride_wn
    up_cols = w_base + (offs_n + INTER).to(tl.int64)[None, :] * stride_wn
    dtype = x_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < HIDDEN
        a = tl.load(x_rows + ks[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_n[None, :]
        wg = tl.load(gate_cols + ks[:, None], mask=mask_w, other=0.0).to(dtype)
        wu = tl.load(up_cols + ks[:, None], mask=mask_w, other=0.0).to(dtype)
        if IEEE:
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    if HAS_BIAS:
        b = bias_ptr + expert.to(tl.int64) * stride_be
        acc_g += tl.load(b + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b + INTER + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if OAI:  # gpt-oss: gate clamped from above, up on both sides
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        act = acc_g * tl.sigmoid(acc_g) * acc_u
    out = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(act_ptr, w_ptr, bias_ptr, topk_weights_ptr, y_ptr, sorted_ptr,
                     block_expert_ptr, num_pairs, num_experts, HIDDEN, INTER,
                     stride_am, stride_we, stride_wn, stride_be, stride_ym,
                     HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    valid = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    a_rows = act_ptr + rows.to(tl.int64)[:, None] * stride_am
    w_cols = (w_ptr + expert.to(tl.int64) * stride_we
              + offs_n.to(tl.int64)[None, :] * stride_wn)
    dtype = act_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask_k = ks < INTER
        a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0).to(dtype)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        b = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(b + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)
    acc = acc * weight[:, None]
    out = y_ptr + pairs.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc, mask=valid[:, None] & mask_n[None, :])


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """(sorted [num_blocks * block_m] int32: pair index by padded row, num_pairs where padding;
    block_expert [num_blocks] int32: each block's expert, num_experts for unused blocks).
    Torch ops on topk_ids' device; num_blocks is an upper bound, known without a host sync."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    num_blocks = -(-num_pairs // block_m) + min(num_experts, num_pairs)
    order = torch.argsort(flat, stable=True)  # pairs by expert, token order within one
    expert_of = flat[order]
    # Each expert's end in the sorted pairs (bincount would read its max on the host).
    experts = torch.arange(num_experts, device=device, dtype=flat.dtype)
    ends = torch.searchsorted(expert_of, experts, right=True)  # [E]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    rank = torch.arange(num_pairs, device=device) - (ends - counts)[expert_of]
    dest = (padded_ends - padded)[expert_of] + rank
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.int()
    starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, starts, right=True).int()  # E past the end
    return sorted_ids, block_expert


def launch_config(dtype: torch.dtype) -> dict:
    """Tiles: independent of the number of tokens (batch invariance)."""
    if dtype == torch.float32:
        return dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: str = "silu",
              swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702) -> torch.Tensor:
    assert activation in twins.MOE_ACTIVATIONS, f"activation is one of {twins.MOE_ACTIVATIONS}"
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    intermediate = two_i // 2
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_experts, 2 * intermediate, hidden), "w13 must be [E, 2I, hidden]"
    assert w2.shape == (num_experts, hidden, intermediate), "w2 must be [E, hidden, I]"
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    if num_tokens == 0:
        return torch.empty_like(x)
    num_pairs = num_tokens * top_k
    sorted_ids, block_expert = align_blocks(topk_ids, num_experts)
    num_blocks = block_expert.shape[0]
    config = launch_config(x.dtype)
    tiles = {key: config[key] for key in ("BLOCK_N", "BLOCK_K")}
    options = {key: config[key] for key in ("num_warps", "num_stages")}
    ieee = x.dtype == torch.float32
    act = torch.empty((num_blocks * BLOCK_M, intermediate), dtype=x.dtype, device=x.device)
    b13 = w13_bias.contiguous() if w13_bias is not None else w13
    grid = (num_blocks, triton.cdiv(intermediate, tiles["BLOCK_N"]))
    _moe_gate_up_kernel[grid](
        x, w13, b13, act, sorted_ids, block_expert, num_pairs, num_experts, top_k, hidden,
        intermediate, x.stride(0), w13.stride(0), w13.stride(1),
        b13.stride(0) if w13_bias is not None else 0, act.stride(0),
        float(swiglu_limit), float(swiglu_alpha),
        OAI=activation == "swigluoai", HAS_BIAS=w13_bias is not None, IEEE=ieee,
        BLOCK_M=BLOCK_M, **tiles, **options,
    )  # fmt: skip
    y = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    b2 = w2_bias.contiguous() if w2_bias is not None else w2
    weights = topk_weights.reshape(-1).float().contiguous()
    grid = (num_blocks, triton.cdiv(hidden, tiles["BLOCK_N"]))
    _moe_down_kernel[grid](
        act, w2, b2, weights, y, sorted_ids, block_expert, num_pairs, num_experts, hidden,
        intermediate, act.stride(0), w2.stride(0), w2.stride(1),
        b2.stride(0) if w2_bias is not None else 0, y.stride(0),
        HAS_BIAS=w2_bias is not None, IEEE=ieee, BLOCK_M=BLOCK_M, **tiles, **options,
    )  # fmt: skip
    # The sum over a token's slots, slot by slot (elementwise adds: no atomics, and a token's
    # sum does not depend on the other tokens).
    y = y.view(num_tokens, top_k, hidden)
    out = y[:, 0].clone()
    for slot in range(1, top_k):
        out += y[:, slot]
    return out.to(x.dtype)
