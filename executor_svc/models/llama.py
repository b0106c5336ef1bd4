"""Llama (2 and 3): pre-norm decoder, GQA attention with RoPE, SwiGLU MLP.

Module names follow the HF checkpoint keys (``model.layers.N.self_attn.o_proj``...), except the
fused projections listed in `packed_modules`: ``qkv_proj`` holds q_proj|k_proj|v_proj and
``gate_up_proj`` holds gate_proj|up_proj, stacked along the output rows.

Tokens arrive flattened: one row per scheduled token of every request, ``[num_tokens, hidden]``;
`BatchMetadata` says which rows belong to which request and where their K/V live.

Tensor parallel (models/parallel.py): each rank runs num_heads / tp q heads and
`local_kv_heads` KV heads (its KV cache holds only those), intermediate_size / tp of the MLP,
and a ceil(vocab / tp) range of the embedding and LM head; o_proj, down_proj and the embedding
end in an all_reduce, so every rank holds the whole residual stream. `compute_logits` returns
the logits on rank 0 and None on the other ranks. With one rank nothing communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from executor_svc.loading.model_config import ModelConfig, check_tensor_parallel, local_kv_heads
from executor_svc.models.layers import GatedMLP, RMSNorm
from executor_svc.models.parallel import (
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TiedParallelLMHead,
    VocabParallelEmbedding,
)
from executor_svc.models.rope import build_cos_sin_cache
from executor_svc.parallel import distributed
from executor_svc.step.attention import AttentionBackend
from executor_svc.step.batch import BatchMetadata
from kernels import rotary

if TYPE_CHECKING:
    from executor_svc.kv.kv_cache import LayerKV


class LlamaAttention(nn.Module):
    """One layer's attention. Its window is the config's for `layer_idx` (0: full causal
    attention; w > 0: a query at p sees keys p-w+1..p) and its softcap the config's
    attn_logit_softcapping (0: none); both go to the backend on every call."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, layer_idx: int):
        super().__init__()
        tp = distributed.tp_size()
        # This rank's heads (all of them with one rank).
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = local_kv_heads(cfg, tp)
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim  # RoPE's leading dimensions of each head
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, qkv_bias, dtype)
        self.split_sizes = self.qkv_proj.local_sizes  # [q, k, v] rows of this rank
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, o_bias,
                                        dtype)
        self.scale = cfg.attention_scale
        self.window = cfg.layer_windows[layer_idx]
        self.softcap = cfg.attn_logit_softcapping
        self.backend = backend
        # This layer's slice of the paged KV cache and its KV group (executor_svc/kv/groups.py:
        # whose block tables it reads), bound once by `bind_kv_cache`.
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v_cache: torch.Tensor | None = None
        # A quantized cache's scales [num_blocks, block_size, num_kv_heads] fp32 (kv_cache.py).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kv_group = 0

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for families that normalise q and k per head before RoPE (Qwen3)."""
        return q, k

    def attention_sinks(self) -> torch.Tensor | None:
        """Hook for families with attention sinks (gpt-oss): this rank's heads' sink logits,
        [num_heads] fp32, handed to the backend; None: no sinks."""
        return None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: BatchMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        # Strided views into qkv, no copies: the kernels need only head_dim contiguous.
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        if self.rotary_dim == self.head_dim:
            rotary(positions, q, k, cos_sin_cache)  # in place
        else:  # partial RoPE: the table's rotary_dim columns rotate, the rest pass through
            rotary(positions, q[..., :self.rotary_dim], k[..., :self.rotary_dim], cos_sin_cache)
        assert self.k_cache is not None and self.v_cache is not None, "KV cache not bound"
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache,
                                   batch.for_group(self.kv_group), self.scale,
                                   window=self.window, softcap=self.softcap,
                                   sinks=self.attention_sinks(), k_scale=self.k_scale,
                                   v_scale=self.v_scale)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: LlamaAttention, dtype: torch.dtype,
                 ffn: nn.Module | None = None, ffn_name: str = "mlp"):
        """`ffn`: the feed-forward block (default: the gated MLP), registered under the
        checkpoint's name for it (`ffn_name`: Mixtral's is block_sparse_moe)."""
        super().__init__()
        self.self_attn = self_attn
        if ffn is None:
            ffn = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype,
                           cfg.hidden_activation)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: BatchMetadata, cos_sin_cache: torch.Tensor):
        # The residual stream is carried separately so each norm can fuse the preceding add.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch, cos_sin_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.ffn_name)(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[LlamaDecoderLayer], dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: BatchMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, batch, cos_sin_cache)
        x, _ = self.norm(x, residual)
        return x  # [num_tokens, hidden]


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. Subclasses change the attention through the class attributes and
    `make_attention`, or the whole decoder through `make_model` (Gemma)."""

    packed_modules: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    attention_cls: type[LlamaAttention] = LlamaAttention
    cuda_graphs = True  # decode steps may replay captured graphs (executor_svc/worker.py)

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, max_model_len: int,
                 backend: AttentionBackend, device: torch.device | str = "cpu"):
        super().__init__()
        check_tensor_parallel(cfg, distributed.tp_size())
        self.cfg = cfg
        self.model = self.make_model(cfg, backend, dtype)
        self.lm_head: ParallelLMHead | TiedParallelLMHead
        if cfg.tie_word_embeddings:
            # Not a module: no second parameter (the embedding's shard is the head's).
            self.lm_head = TiedParallelLMHead(self.model.embed_tokens)
        else:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)
        # A plain attribute, not a buffer: the loader builds parameters on the meta device and
        # materialises them empty, which would wipe a buffer. fp32 for accurate angles.
        self.cos_sin_cache = build_cos_sin_cache(cfg.rope, cfg.rotary_dim, max_model_len, device)

    @classmethod
    def make_model(cls, cfg: ModelConfig, backend: AttentionBackend,
                   dtype: torch.dtype) -> nn.Module:
        layers = [LlamaDecoderLayer(cfg, cls.make_attention(cfg, backend, dtype, i), dtype)
                  for i in range(cfg.num_layers)]
        return LlamaModel(cfg, layers, dtype)

    @classmethod
    def make_attention(cls, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                       layer_idx: int) -> LlamaAttention:
        return cls.attention_cls(cfg, backend, dtype, qkv_bias=cfg.attention_bias,
                                 o_bias=cfg.attention_bias, layer_idx=layer_idx)

    def lm_head_weight(self) -> torch.Tensor:
        """This rank's rows of the LM head ([ceil(vocab / tp), hidden]; [vocab, hidden] alone;
        a converted GGUF file's kept head: uint8 [rows, row_bytes] of blocks)."""
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def bind_kv_cache(self, kv_caches: list[LayerKV],
                      layer_groups: Sequence[int] | None = None) -> None:
        """Give layer i its cache (tensors and scales, kv_cache.per_layer()) and KV group
        (None: all group 0); done once, before the first step."""
        layers = self.attention_layers()
        assert len(kv_caches) == len(layers)
        groups = layer_groups if layer_groups is not None else [0] * len(layers)
        for attn, kv, group in zip(layers, kv_caches, groups, strict=True):
            attn.k_cache, attn.v_cache, attn.kv_group = kv.k_cache, kv.v_cache, group
            attn.k_scale, attn.v_scale = kv.k_scale, kv.v_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: BatchMetadata) -> torch.Tensor | None:
        """input_ids, positions [num_tokens] -> float32 logits [num_logits, vocab] for the rows
        in ``batch.logits_indices`` only; on rank 0 only (None elsewhere), as compute_logits."""
        hidden = self.hidden_states(input_ids, positions, batch)
        return self.compute_logits(hidden[batch.logits_indices])

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      batch: BatchMetadata) -> torch.Tensor:
        """The decoder alone (what a decode graph captures) -> [num_tokens, hidden]."""
        return self.model(input_ids, positions, batch, self.cos_sin_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [num_logits, hidden] -> float32 logits [num_logits, vocab] on tensor-parallel
        rank 0 (and with one rank), None on the others. Every rank must call it (it gathers
        the ranks' vocab slices); only rank 0 samples."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()
