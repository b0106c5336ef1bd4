"""Mixtral: Mistral's attention (GQA, optional sliding window on every layer) with a sparse MoE
block in every layer: softmax router over num_local_experts, top-k renormalised, experts of
intermediate_size (models/moe.py). Checkpoint keys: ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.N.w1/w3/w2`` (gate, up, down)."""

from __future__ import annotations

from executor_svc.models.moe import MIXTRAL_EXPERT_PARTS, MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    ffn_name = "block_sparse_moe"
    expert_part_names = MIXTRAL_EXPERT_PARTS
    round_router_weights = False  # HF's Mixtral router keeps its weights in fp32
