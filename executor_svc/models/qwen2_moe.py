"""Qwen2-MoE: Qwen2's attention (q/k/v biases per qkv_bias, none on o_proj) with sparse MoE
blocks (softmax router, top-k renormalised only with norm_topk_prob, experts of
moe_intermediate_size) plus a shared expert of shared_expert_intermediate_size scaled by
sigmoid(shared_expert_gate(x)); dense MLPs of intermediate_size on the mlp_only_layers and off
the decoder_sparse_step (models/moe.py)."""

from __future__ import annotations

import torch

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.llama import LlamaAttention
from executor_svc.models.moe import MoeForCausalLM
from executor_svc.step.attention import AttentionBackend


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def make_attention(cls, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                       layer_idx: int) -> LlamaAttention:
        # attention_bias holds qkv_bias here (model_config._attention_bias).
        return cls.attention_cls(cfg, backend, dtype, qkv_bias=cfg.attention_bias,
                                 o_bias=False, layer_idx=layer_idx)
