"""Verification of speculative proposals: which of a request's k proposed tokens the target
model accepts, and the token it adds after them, for a whole batch at once.

The target model scores a request's last token and its k proposals d_0..d_{k-1} in one
forward pass: position i's distribution p_i predicts the token after d_{i-1} (p_0 the one after
the last real token). A request may propose fewer than k tokens (`num_draft`; the rest of its
row is padding, -1). Given the target's own token t_i at every position (the argmax for greedy
requests, the sampler's draw for the others: executor_svc/spec/verifier.py), the proposals are
accepted while d_i = t_i; at the first i = a where they differ (or after the last proposal)
t_a is emitted after d_0..d_{a-1}. Greedy, that is exactly non-speculative greedy decoding;
sampled, it is rejection sampling for deterministic proposals (verifier.py says why).
Each request emits 1..num_draft+1 tokens.
"""

from __future__ import annotations

import torch


def _accepted(accept: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """[R, k] per-position acceptance -> [R] the count accepted before the first rejection
    (padding positions past num_draft count as rejections)."""
    k = accept.shape[1]
    in_draft = torch.arange(k, device=accept.device)[None, :] < num_draft[:, None]
    return torch.cumprod((accept & in_draft).to(torch.int64), dim=1).sum(dim=1)


def _emit(draft: torch.Tensor, last: torch.Tensor, accepted: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [R, k+1]: the accepted drafts, then `last` [R], then -1; and counts [R]."""
    num_reqs, k = draft.shape
    pos = torch.arange(k + 1, device=draft.device)[None, :]
    padded = torch.cat([draft, draft.new_full((num_reqs, 1), -1)], dim=1)
    tokens = torch.where(pos < accepted[:, None], padded, -1)
    tokens = torch.where(pos == accepted[:, None], last[:, None], tokens)
    return tokens, accepted + 1


def verify(target_ids: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [R, k+1] (the target's own token at each position: its argmax, or what the
    sampler draws), draft [R, k] (-1 padded), num_draft [R] -> (tokens [R, k+1] -1 padded,
    counts [R])."""
    accepted = _accepted(target_ids[:, :-1] == draft, num_draft)
    last = target_ids.gather(1, accepted[:, None]).squeeze(1)
    return _emit(draft, last, accepted)
