"""Verification of speculative proposals: which of a request's k proposed tokens the target
model accepts, and the token it adds after them, for a whole batch at once.

The target model scores a request's last token and its k proposals d_0..d_{k-1} in one
forward pass: position i's distribution p_i predicts the token after d_{i-1} (p_0 the one after
the last real token). A request may propose fewer than k tokens (`num_draft`; the rest of its
row is padding, -1).

- Greedy: accept while the target's argmax agrees, a = the first i with argmax p_i != d_i;
  emit d_0..d_{a-1} and argmax p_a. The output is exactly non-speculative greedy decoding.
- Sampling (Leviathan et al. / Chen et al.'s rejection sampling): accept d_i with probability
  min(1, p_i(d_i) / q_i(d_i)), q_i the draft's distribution (one-hot for n-gram proposals:
  then the probability is p_i(d_i)); at the first rejection a, draw from the residual
  max(0, p_a - q_a) renormalised; when all are accepted draw the extra token from p_a. Every
  emitted token is then distributed exactly as the target alone would draw it.

Each request emits 1..num_draft+1 tokens. The randomness comes in as arguments (`uniforms`
for the acceptance tests, `noise` Exp(1) variates for the exponential-race draws, as
executor_svc/sampler.py draws), so a seeded request's stream can be counter-based like the
sampler's and these functions stay pure.
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


def verify_greedy(target_ids: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [R, k+1] (argmax at each position), draft [R, k] (-1 padded), num_draft [R]
    -> (tokens [R, k+1] -1 padded, counts [R])."""
    accepted = _accepted(target_ids[:, :-1] == draft, num_draft)
    last = target_ids.gather(1, accepted[:, None]).squeeze(1)
    return _emit(draft, last, accepted)


def rejection_sample(target_probs: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor,
                     draft_probs: torch.Tensor | None, uniforms: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [R, k+1, V]; draft [R, k] (-1 padded); num_draft [R]; draft_probs [R, k, V]
    or None (one-hot proposals, n-gram); uniforms [R, k] in [0, 1); noise [R, k+1, V] Exp(1)
    -> (tokens [R, k+1] -1 padded, counts [R])."""
    num_reqs, k = draft.shape
    ids = draft.clamp(min=0)[:, :, None]  # padding reads token 0; it is never accepted
    p_draft = target_probs[:, :k].gather(2, ids).squeeze(2)  # [R, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        q = torch.zeros_like(target_probs[:, :k]).scatter_(2, ids, 1.0)
    else:
        q_draft = draft_probs.gather(2, ids).squeeze(2)
        q = draft_probs
    accepted = _accepted(uniforms * q_draft < p_draft, num_draft)
    # Position a's distribution: the residual after a rejection, p itself after every draft.
    rows = torch.arange(num_reqs, device=draft.device)
    p_a = target_probs[rows, accepted]  # [R, V]
    rejected = accepted < num_draft
    q_a = q[rows, accepted.clamp(max=k - 1)] if k else torch.zeros_like(p_a)
    residual = torch.where(rejected[:, None], (p_a - q_a).clamp(min=0), p_a)
    # A residual of zeros (p == q to rounding) was rejected with probability ~0: use p.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_a)
    last = (residual / noise[rows, accepted]).argmax(dim=1)
    return _emit(draft, last, accepted)
