"""Qwen3: Llama-style attention plus an RMSNorm over each head of q and k before RoPE.

head_dim is explicit in the config (it need not equal hidden_size / num_heads), and q/k/v carry
a bias only when attention_bias is set.
"""

from __future__ import annotations

import torch

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.layers import RMSNorm
from executor_svc.models.llama import LlamaAttention, LlamaForCausalLM
from executor_svc.step.attention import AttentionBackend


class Qwen3Attention(LlamaAttention):
    norm_cls: type[RMSNorm] = RMSNorm  # Gemma 3 swaps in its own norm

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, layer_idx: int):
        super().__init__(cfg, backend, dtype, qkv_bias, o_bias, layer_idx)
        self.q_norm = self.norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = self.norm_cls(cfg.head_dim, cfg.rms_norm_eps, dtype)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim]:
        # rms_norm takes 2-D input, so every head becomes a row.
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return q, k


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
