"""The grouped form of a mixture-of-experts MLP, any device: the step's (token, slot) pairs
sorted by expert (stable: token order within an expert), one gather of their rows, the MLP of
each expert some token chose on its contiguous run of rows, and one index_add_ of the rows
weighted by their router weights back into token order, in fp32. An expert nobody chose is
never called. The CPU backend's torch path (kernels/cpu/) and the quantized experts
(executor_svc/quantization/experts.py) share it; each supplies the expert's MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch


def grouped_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int,
                expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, hidden], topk_weights [T, k], topk_ids [T, k]; `expert_mlp(e, rows)`: expert e on
    `rows` [n, hidden] (x's rows, x's dtype) -> [n, hidden] (fp32 or x's dtype). Returns
    [T, hidden] in x's dtype."""
    num_tokens, hidden = x.shape
    flat = topk_ids.reshape(-1).long()  # [pairs]
    order = torch.argsort(flat, stable=True)  # pairs by expert, token order within one
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // topk_ids.shape[1]
    xs = x.index_select(0, tokens)  # [pairs, hidden], sorted
    ys = torch.empty((flat.numel(), hidden), dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            ys[start:start + count] = expert_mlp(expert, xs[start:start + count]).float()
            start += count
    ys.mul_(topk_weights.reshape(-1).float().index_select(0, order)[:, None])
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, ys)
    return out.to(x.dtype)
