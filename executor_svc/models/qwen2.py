"""Qwen2: the Llama architecture with a bias on the q, k and v projections (none on o_proj).

With use_sliding_window the layers from max_window_layers on attend within sliding_window
(`ModelConfig.layer_windows`); the attention layers honour it like any window."""

from __future__ import annotations

import torch

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.llama import LlamaAttention, LlamaForCausalLM
from executor_svc.step.attention import AttentionBackend


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_attention(cls, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                       layer_idx: int) -> LlamaAttention:
        # Qwen2 checkpoints always carry q/k/v biases, whatever attention_bias says.
        return cls.attention_cls(cfg, backend, dtype, qkv_bias=True, o_bias=False,
                                 layer_idx=layer_idx)
