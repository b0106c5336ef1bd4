"""An independent float64 reference for the fused MoE MLP, token by token and choice by choice,
and random expert weights to feed it. Shared by the twin's, the CPU path's and the Triton
kernel's tests."""

from __future__ import annotations

import torch


def reference_moe(x, w13, w2, topk_weights, topk_ids, *, w13_bias=None, w2_bias=None,
                  activation="silu", swiglu_limit=7.0, swiglu_alpha=1.702) -> torch.Tensor:
    """[num_tokens, hidden] float64."""
    num_tokens, hidden = x.shape
    intermediate = w2.shape[2]
    out = torch.zeros((num_tokens, hidden), dtype=torch.float64)
    for t in range(num_tokens):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = w13[e].double() @ x[t].double()
            if w13_bias is not None:
                h = h + w13_bias[e].double()
            gate, up = h[:intermediate], h[intermediate:]
            if activation == "silu":
                a = gate / (1 + torch.exp(-gate)) * up
            else:
                gate = torch.clamp(gate, max=swiglu_limit)
                up = torch.clamp(up, min=-swiglu_limit, max=swiglu_limit)
                a = (up + 1) * gate / (1 + torch.exp(-swiglu_alpha * gate))
            y = w2[e].double() @ a
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[t] += float(topk_weights[t, k]) * y
    return out


def random_experts(num_experts: int, hidden: int, intermediate: int, dtype=torch.float32,
                   bias: bool = False, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(shape, generator=gen) * scale).to(dtype)

    weights = dict(w13=rand(num_experts, 2 * intermediate, hidden, scale=hidden ** -0.5),
                   w2=rand(num_experts, hidden, intermediate, scale=intermediate ** -0.5))
    if bias:
        weights.update(w13_bias=rand(num_experts, 2 * intermediate, scale=0.5),
                       w2_bias=rand(num_experts, hidden, scale=0.5))
    return weights


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 0,
                   only: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, topk_ids [T, k] int64): distinct experts per token, weights
    summing to 1; `only`: every token's first choice is that expert."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(num_tokens)])
    if only is not None:
        for row in ids:
            if only in row.tolist():
                row[row.tolist().index(only)] = row[0].item()
            row[0] = only
    weights = torch.softmax(torch.randn((num_tokens, top_k), generator=gen), dim=-1)
    return weights, ids
