"""Gemma 3 (text): Gemma 2's decoder plus a Gemma RMSNorm over each head of q and k before
RoPE, and two RoPE tables: the sliding-window (local) layers rotate with their own unscaled
base (``rope_local_base_freq``, or ``rope_parameters.sliding_attention``), the full-attention
(global) layers with the model's RoPE, scaled as the config says. HF's Gemma 3 applies no
attention-score softcap, whatever attn_logit_softcapping says; the final logit cap applies
when set. Serves ``Gemma3ForCausalLM`` checkpoints (model_type gemma3_text).
"""

from __future__ import annotations

import torch

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.gemma2 import Gemma2ForCausalLM, GemmaRMSNorm
from executor_svc.models.qwen3 import Qwen3Attention
from executor_svc.models.rope import build_cos_sin_cache
from executor_svc.step.attention import AttentionBackend
from executor_svc.step.batch import BatchMetadata


class Gemma3Attention(Qwen3Attention):
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, layer_idx: int):
        super().__init__(cfg, backend, dtype, qkv_bias, o_bias, layer_idx)
        self.softcap = 0.0  # HF's Gemma 3 attention passes no softcap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = Gemma3Attention

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, max_model_len: int,
                 backend: AttentionBackend, device: torch.device | str = "cpu"):
        super().__init__(cfg, dtype=dtype, max_model_len=max_model_len, backend=backend,
                         device=device)
        # A plain attribute like cos_sin_cache; None: every layer uses cos_sin_cache.
        self.local_cos_sin_cache = (None if cfg.local_rope is None else build_cos_sin_cache(
            cfg.local_rope, cfg.rotary_dim, max_model_len, device))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      batch: BatchMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, batch, self.cos_sin_cache,
                          self.local_cos_sin_cache)
