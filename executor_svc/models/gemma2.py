"""Gemma 2: Llama's attention and projections, rearranged the Gemma way.

- Embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype (as HF does).
- Four norms per layer: input and post_attention around the attention, pre_feedforward and
  post_feedforward around the MLP; each sublayer's output is normed before the residual add.
- The MLP is GeGLU (GELU, tanh approximation), the attention scale query_pre_attn_scalar^-0.5.
- Attention scores are tanh-capped at attn_logit_softcapping, the logits at
  final_logit_softcapping; layers alternate sliding-window and full attention
  (`ModelConfig.layer_windows`); the LM head is tied to the embedding.

Gemma's RMSNorm multiplies by (1 + w). Invariant: once loaded, every `GemmaRMSNorm.weight`
holds 1 + the checkpoint's w (`finish_loading` adds the 1), so the shared rms_norm kernel
(x normed, times weight) computes Gemma's norm. In fp32 that is exact; in 16-bit dtypes 1 + w
is rounded once to the dtype, where HF adds and multiplies in fp32 (a last-bit difference).
"""

from __future__ import annotations

import torch
from torch import nn

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.layers import GatedMLP, RMSNorm
from executor_svc.models.llama import LlamaAttention, LlamaForCausalLM
from executor_svc.models.parallel import VocabParallelEmbedding
from executor_svc.step.attention import AttentionBackend
from executor_svc.step.batch import BatchMetadata


class GemmaRMSNorm(RMSNorm):
    """normed(x) * (1 + w), with `weight` holding 1 + w once loaded (see the module doc)."""


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: LlamaAttention, dtype: torch.dtype):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, dtype,
                            cfg.hidden_activation)
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: BatchMetadata, cos_sin_cache: torch.Tensor):
        # As Llama's: the residual stream is carried apart, each pre-norm fuses the add of the
        # previous sublayer's (post-normed) output; returns (output, residual) unsummed.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch, cos_sin_cache)
        x = self.post_attention_layernorm(x)
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x = self.post_feedforward_layernorm(self.mlp(x))
        return x, residual


class Gemma2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[Gemma2DecoderLayer], dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # sqrt(hidden) rounded to the model dtype, as HF multiplies by it (a CPU tensor: the
        # model may be built under a meta-device context).
        self.normalizer = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device="cpu"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: BatchMetadata,
                cos_sin_cache: torch.Tensor,
                local_cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
        """`local_cos_sin_cache`: the table of the sliding-window layers when theirs differs
        (Gemma 3); the others, and all of them without it, use `cos_sin_cache`."""
        x = self.embed_tokens(input_ids) * self.normalizer  # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            local = local_cos_sin_cache is not None and layer.self_attn.window > 0
            x, residual = layer(positions, x, residual, batch,
                                local_cos_sin_cache if local else cos_sin_cache)
        x, _ = self.norm(x, residual)
        return x  # [num_tokens, hidden]


class Gemma2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_model(cls, cfg: ModelConfig, backend: AttentionBackend,
                   dtype: torch.dtype) -> nn.Module:
        layers = [Gemma2DecoderLayer(cfg, cls.make_attention(cfg, backend, dtype, i), dtype)
                  for i in range(cfg.num_layers)]
        return Gemma2Model(cfg, layers, dtype)

    def finish_loading(self) -> None:
        """Called by the loader once the checkpoint is in: establish GemmaRMSNorm's invariant
        (weight = 1 + the checkpoint's w). Never call it twice."""
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.weight.add_(1.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)  # float32, rank 0 only
        cap = self.cfg.final_logit_softcapping
        if logits is None or not cap:
            return logits
        return torch.tanh(logits / cap) * cap
