"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, explicit head_dim) with sparse MoE
blocks (softmax router, top-k renormalised with norm_topk_prob, experts of
moe_intermediate_size, no shared expert); dense MLPs of intermediate_size on the
mlp_only_layers and off the decoder_sparse_step (models/moe.py)."""

from __future__ import annotations

from executor_svc.models.moe import MoeForCausalLM
from executor_svc.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(MoeForCausalLM):
    attention_cls = Qwen3Attention
