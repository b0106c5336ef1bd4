"""gpt-oss (GptOssForCausalLM, transformers 5.24's modeling_gpt_oss.py), fp32/bf16 weights.

- Attention: q/k/v/o with biases, GQA, an explicit head_dim, YaRN RoPE (rotate-half pairs, as
  every Folio model), sliding-window and full layers as ``layer_types`` says (alternating,
  sliding first, without it), and one learned sink logit per q head (``self_attn.sinks``) that
  joins each softmax's denominator (`kernels.paged_attention`). The sinks are held in fp32
  (a bf16 checkpoint's values convert exactly, once, as they load).
- MLP: a mixture of experts in every layer. The router (``mlp.router``, weight and bias)
  takes the top k of its logits, then a softmax over those k (in the model dtype, as HF's);
  unlike Mixtral's softmax-then-top-k. Each expert is ``down(swigluoai(gate_up(x) + b13)) +
  b2``, weighted by its router weight (b2 included), with gpt-oss's clamped SwiGLU: gate
  clamped above and up on both sides at ``swiglu_limit``, then ``(up + 1) * gate *
  sigmoid(swiglu_alpha * gate)``.
- RMSNorm before attention and MLP and at the end; the LM head is not tied.

Expert tensors, as HF's module holds them and save_pretrained writes them (3-D, no per-expert
tensors): ``experts.gate_up_proj`` [E, hidden, 2I] with gate and up interleaved along the last
dimension (gate = [..., 0::2], up = [..., 1::2]), ``experts.gate_up_proj_bias`` [E, 2I] likewise,
``experts.down_proj`` [E, I, hidden] and ``experts.down_proj_bias`` [E, hidden]. `GptOssExperts`
reads them as they are (each tensor-parallel rank its slice of the intermediate dimension: a
contiguous range of 2 * I / tp interleaved columns, gate and up alike) and `finish_loading`
rearranges them once into the layout `kernels.fused_moe` takes: w13 [E, 2I/tp, hidden] (gate
rows, then up rows), w2 [E, hidden, I/tp]. The down bias is added by rank 0 only, so the
all_reduce that completes the experts' sum counts it once.

MXFP4 expert weights (how openai ships gpt-oss) are refused by checkpoints/quant_config.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.loading.model_config import ModelConfig
from executor_svc.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from executor_svc.models.moe import Experts
from executor_svc.models.parallel import WeightShard
from executor_svc.parallel import distributed
from executor_svc.step.attention import AttentionBackend

# The checkpoint's expert tensors, in the order `finish_loading` consumes them.
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssAttention(LlamaAttention):
    """Llama's attention with biases on q/k/v/o and a sink logit per q head."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype,
                 qkv_bias: bool, o_bias: bool, layer_idx: int):
        super().__init__(cfg, backend, dtype, qkv_bias, o_bias, layer_idx)
        self.tp_rank = distributed.tp_rank()
        self.total_heads = cfg.num_heads
        # This rank's heads' sinks, fp32 whatever the model dtype (the kernels take fp32).
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32),
                                  requires_grad=False)

    def attention_sinks(self) -> torch.Tensor:
        return self.sinks

    def weight_shard(self, param_name: str, shard_id: int | None) -> WeightShard:
        """The loader's question for the parameters this module owns itself: the sinks, of
        which each rank reads its q heads' entries."""
        assert param_name == "sinks", param_name
        return WeightShard((self.total_heads,), 0, self.tp_rank * self.num_heads, self.num_heads)


class GptOssRouter(nn.Module):
    """x [T, hidden] -> (weights [T, k] fp32, expert ids [T, k]): top k of the logits
    (x W^T + b, in the model dtype), then a softmax over those k in the model dtype, as
    HF's GptOssTopKRouter. Replicated on every rank."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=dtype), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)  # [T, num_experts]
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        return weights.float(), ids


class GptOssExperts(Experts):
    """Every expert's clamped-SwiGLU MLP with biases. Loads the checkpoint's interleaved 3-D
    tensors (module docstring) and rearranges them in `finish_loading`; `forward` needs that
    done."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.tp_size, self.tp_rank = distributed.tp_size(), distributed.tp_rank()
        self.num_experts, self.hidden_size = cfg.num_experts, cfg.hidden_size
        self.intermediate_size = cfg.moe_intermediate_size
        assert self.intermediate_size % self.tp_size == 0, "checked by check_tensor_parallel"
        self.local_intermediate = self.intermediate_size // self.tp_size
        self.swiglu_limit, self.swiglu_alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        e, h, il = self.num_experts, self.hidden_size, self.local_intermediate
        # The checkpoint's layout, this rank's slices (replaced by `finish_loading`).
        for name, shape in (("gate_up_proj", (e, h, 2 * il)), ("gate_up_proj_bias", (e, 2 * il)),
                            ("down_proj", (e, il, h)), ("down_proj_bias", (e, h))):
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype),
                                                       requires_grad=False))
        self.loaded = False

    def moe_options(self) -> dict:
        assert self.loaded, "GptOssExperts.finish_loading was not called"
        return dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias if self.tp_rank == 0 else None,
                    activation="swigluoai", swiglu_limit=self.swiglu_limit,
                    swiglu_alpha=self.swiglu_alpha)

    def finish_loading(self) -> None:
        """Checkpoint layout -> fused_moe's: de-interleave gate and up into halves, put the
        output dimension first. One layer at a time, the checkpoint-layout copies freed."""
        il = self.local_intermediate
        gate_up = self.gate_up_proj.data  # [E, hidden, 2 * il], gate/up interleaved
        # Written in place: one new copy of the weights, no intermediate ones.
        w13 = gate_up.new_empty((self.num_experts, 2 * il, self.hidden_size))
        w13[:, :il].copy_(gate_up[..., 0::2].transpose(1, 2))  # gate rows
        w13[:, il:].copy_(gate_up[..., 1::2].transpose(1, 2))  # up rows
        bias = self.gate_up_proj_bias.data
        w13_bias = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1)
        w2 = self.down_proj.data.transpose(1, 2).contiguous()  # [E, hidden, il]
        w2_bias = self.down_proj_bias.data
        for name in EXPERT_TENSORS:
            delattr(self, name)
        for name, value in (("w13", w13), ("w13_bias", w13_bias), ("w2", w2),
                            ("w2_bias", w2_bias)):
            self.register_parameter(name, nn.Parameter(value, requires_grad=False))
        self.loaded = True

    # Loading (executor_svc/loading/loader.py): labels are checkpoint tensor names relative to
    # this module.

    def checkpoint_parts(self, param_name: str) -> list[str]:
        """The checkpoint tensor that fills parameter `param_name`: the one of its name."""
        return [param_name]

    def checkpoint_placements(self, key: str) -> list[tuple[str, list[str], WeightShard]] | None:
        """Where checkpoint tensor `key` goes on this rank; None when it is none of the four.
        The interleaved gate/up columns of intermediate rows [start, start + il) are the
        contiguous range [2 * start, 2 * (start + il))."""
        e, h, n, il = (self.num_experts, self.hidden_size, self.intermediate_size,
                       self.local_intermediate)
        start = self.tp_rank * il
        shards = {
            "gate_up_proj": WeightShard((e, h, 2 * n), 2, 2 * start, 2 * il),
            "gate_up_proj_bias": WeightShard((e, 2 * n), 1, 2 * start, 2 * il),
            "down_proj": WeightShard((e, n, h), 1, start, il),
            "down_proj_bias": WeightShard((e, h)),  # whole on every rank; rank 0 adds it
        }
        if key not in shards:
            return None
        return [(key, [key], shards[key])]


class GptOssMLP(nn.Module):
    """Router and experts; one all_reduce under tensor parallelism."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.tp_size = distributed.tp_size()
        self.router = GptOssRouter(cfg, dtype)
        self.experts = GptOssExperts(cfg, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.router.route(x)
        out = self.experts(x, topk_weights, topk_ids)
        return out if self.tp_size == 1 else distributed.all_reduce(out)


class GptOssForCausalLM(LlamaForCausalLM):
    attention_cls = GptOssAttention
    # No decode CUDA graphs (executor_svc/worker.py): kernels.fused_moe's twin picks the
    # routed experts on the host.
    cuda_graphs = False
    has_sinks = True  # the CUDA warm-up compiles the attention's sink variants

    @classmethod
    def make_model(cls, cfg: ModelConfig, backend: AttentionBackend,
                   dtype: torch.dtype) -> nn.Module:
        layers = [LlamaDecoderLayer(cfg, cls.make_attention(cfg, backend, dtype, i), dtype,
                                    GptOssMLP(cfg, dtype))
                  for i in range(cfg.num_layers)]
        return LlamaModel(cfg, layers, dtype)  # type: ignore[arg-type]

    def finish_loading(self) -> None:
        """Called by the loader once the checkpoint is in: the experts' layout change."""
        for module in self.modules():
            if isinstance(module, GptOssExperts):
                module.finish_loading()
