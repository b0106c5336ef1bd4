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

MXFP4 experts (``quantization_config.quant_method: "mxfp4"``, how openai ships gpt-oss;
`ModelConfig.mxfp4_experts`) are dequantized at load into the model dtype: the checkpoint holds
``gate_up_proj_blocks`` uint8 [E, 2I, hidden/32, 16] and ``gate_up_proj_scales`` [E, 2I,
hidden/32] (rows: the interleaved gate/up columns above, each blocked along hidden),
``down_proj_blocks`` [E, hidden, I/32, 16] and ``down_proj_scales`` [E, hidden, I/32]
(blocked along I), and the biases as floats (executor_svc/loading/mxfp4.py has the encoding).
Each rank reads the uint8 rows of its interleaved gate/up range, and of down the blocks that
hold its intermediate range: a range that does not start or end on a 32-element block (tp 4 of
gpt-oss's I = 2880) reads the shared block whole and keeps its part. `finish_loading` decodes
one expert at a time straight into w13/w2, so no float copy in the checkpoint's layout exists;
from then on the layer is the float one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from checkpoints.files import FLOAT_DTYPES
from executor_svc.loading.model_config import ModelConfig
from executor_svc.loading.mxfp4 import BLOCK_BYTES, BLOCK_SIZE, covering_blocks, dequantize_mxfp4
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

# The checkpoint's expert tensors: float, or (MXFP4) each matrix as its blocks and scales.
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
MXFP4_EXPERT_TENSORS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                        "down_proj_blocks", "down_proj_scales", "down_proj_bias")


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
    tensors, float or MXFP4 (module docstring), and rearranges (and decodes) them in
    `finish_loading`; `forward` needs that done."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.tp_size, self.tp_rank = distributed.tp_size(), distributed.tp_rank()
        self.num_experts, self.hidden_size = cfg.num_experts, cfg.hidden_size
        self.intermediate_size = cfg.moe_intermediate_size
        assert self.intermediate_size % self.tp_size == 0, "checked by check_tensor_parallel"
        self.local_intermediate = self.intermediate_size // self.tp_size
        self.swiglu_limit, self.swiglu_alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.mxfp4 = cfg.mxfp4_experts
        self.float_dtype = dtype  # the model dtype: the biases, and every matrix once loaded
        self.loaded = False
        for name, (shape, param_dtype) in self._checkpoint_params().items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=param_dtype),
                                                       requires_grad=False))

    def _checkpoint_params(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The checkpoint-layout parameters of this rank, replaced by `finish_loading`: name
        -> (shape, dtype). ValueError (naming the config field) for sizes MXFP4 cannot
        block."""
        e, h, il = self.num_experts, self.hidden_size, self.local_intermediate
        biases = {"gate_up_proj_bias": ((e, 2 * il), self.float_dtype),
                  "down_proj_bias": ((e, h), self.float_dtype)}
        if not self.mxfp4:
            return {"gate_up_proj": ((e, h, 2 * il), self.float_dtype),
                    "down_proj": ((e, il, h), self.float_dtype), **biases}
        for field, size in (("hidden_size", h), ("intermediate_size", self.intermediate_size)):
            if size % BLOCK_SIZE:
                raise ValueError(f"{field} ({size}) is not a multiple of {BLOCK_SIZE}: MXFP4 "
                                 f"experts (quantization_config.quant_method 'mxfp4') are "
                                 f"stored in blocks of {BLOCK_SIZE} along it")
        _, num_down_blocks, _ = self._down_blocks()
        u8 = torch.uint8
        return {"gate_up_proj_blocks": ((e, 2 * il, h // BLOCK_SIZE, BLOCK_BYTES), u8),
                "gate_up_proj_scales": ((e, 2 * il, h // BLOCK_SIZE), u8),
                "down_proj_blocks": ((e, h, num_down_blocks, BLOCK_BYTES), u8),
                "down_proj_scales": ((e, h, num_down_blocks), u8), **biases}

    def _down_blocks(self) -> tuple[int, int, int]:
        """This rank's MXFP4 blocks of down's intermediate dimension: (first, count, offset of
        its range in the first)."""
        return covering_blocks(self.tp_rank * self.local_intermediate, self.local_intermediate)

    def moe_options(self) -> dict:
        assert self.loaded, "GptOssExperts.finish_loading was not called"
        return dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias if self.tp_rank == 0 else None,
                    activation="swigluoai", swiglu_limit=self.swiglu_limit,
                    swiglu_alpha=self.swiglu_alpha)

    def finish_loading(self) -> None:
        """Checkpoint layout -> fused_moe's: de-interleave gate and up into halves, put the
        output dimension first (MXFP4: decode too). One layer at a time, the
        checkpoint-layout tensors freed."""
        w13, w2 = self._mxfp4_weights() if self.mxfp4 else self._float_weights()
        bias = self.gate_up_proj_bias.data
        w13_bias = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1)
        w2_bias = self.down_proj_bias.data
        for name in MXFP4_EXPERT_TENSORS if self.mxfp4 else EXPERT_TENSORS:
            delattr(self, name)
        for name, value in (("w13", w13), ("w13_bias", w13_bias), ("w2", w2),
                            ("w2_bias", w2_bias)):
            self.register_parameter(name, nn.Parameter(value, requires_grad=False))
        self.loaded = True

    def _float_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        il = self.local_intermediate
        gate_up = self.gate_up_proj.data  # [E, hidden, 2 * il], gate/up interleaved
        # Written in place: one new copy of the weights, no intermediate ones.
        w13 = gate_up.new_empty((self.num_experts, 2 * il, self.hidden_size))
        w13[:, :il].copy_(gate_up[..., 0::2].transpose(1, 2))  # gate rows
        w13[:, il:].copy_(gate_up[..., 1::2].transpose(1, 2))  # up rows
        w2 = self.down_proj.data.transpose(1, 2).contiguous()  # [E, hidden, il]
        return w13, w2

    def _mxfp4_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded into the model dtype one expert at a time, so the decode's temporaries stay
        the size of one expert's matrix."""
        il, h = self.local_intermediate, self.hidden_size
        _, _, offset = self._down_blocks()
        device = self.gate_up_proj_blocks.device
        w13 = torch.empty((self.num_experts, 2 * il, h), dtype=self.float_dtype, device=device)
        w2 = torch.empty((self.num_experts, h, il), dtype=self.float_dtype, device=device)
        for e in range(self.num_experts):
            # [2 * il, hidden]: row j is HF's interleaved gate/up column j of this rank.
            gate_up = dequantize_mxfp4(self.gate_up_proj_blocks[e], self.gate_up_proj_scales[e],
                                       self.float_dtype)
            w13[e, :il] = gate_up[0::2]
            w13[e, il:] = gate_up[1::2]
            down = dequantize_mxfp4(self.down_proj_blocks[e], self.down_proj_scales[e],
                                    self.float_dtype)  # [hidden, blocks * 32] covering this range
            w2[e] = down[:, offset:offset + il]
        return w13, w2

    # Loading (executor_svc/loading/loader.py): labels are checkpoint tensor names relative to
    # this module.

    def checkpoint_parts(self, param_name: str) -> list[str]:
        """The checkpoint tensor that fills parameter `param_name`: the one of its name."""
        return [param_name]

    def checkpoint_placements(self, key: str) -> list[tuple[str, list[str], WeightShard]] | None:
        """Where checkpoint tensor `key` goes on this rank; None when it is no expert tensor.
        The interleaved gate/up columns of intermediate rows [start, start + il) are the
        contiguous range [2 * start, 2 * (start + il)) (MXFP4: the rows of the blocks and
        scales); MXFP4 down is read by whole blocks of I. ValueError for a float matrix in an
        MXFP4 checkpoint or the reverse."""
        e, h, n, il = (self.num_experts, self.hidden_size, self.intermediate_size,
                       self.local_intermediate)
        start = self.tp_rank * il
        shards = {
            "gate_up_proj_bias": WeightShard((e, 2 * n), 1, 2 * start, 2 * il),
            "down_proj_bias": WeightShard((e, h)),  # whole on every rank; rank 0 adds it
        }
        if self.mxfp4:
            hb, nb = h // BLOCK_SIZE, n // BLOCK_SIZE
            first, count, _ = self._down_blocks()
            shards.update({
                "gate_up_proj_blocks": WeightShard((e, 2 * n, hb, BLOCK_BYTES), 1, 2 * start,
                                                   2 * il),
                "gate_up_proj_scales": WeightShard((e, 2 * n, hb), 1, 2 * start, 2 * il),
                "down_proj_blocks": WeightShard((e, h, nb, BLOCK_BYTES), 2, first, count),
                "down_proj_scales": WeightShard((e, h, nb), 2, first, count),
            })
        else:
            shards.update({
                "gate_up_proj": WeightShard((e, h, 2 * n), 2, 2 * start, 2 * il),
                "down_proj": WeightShard((e, n, h), 1, start, il),
            })
        if key in shards:
            return [(key, [key], shards[key])]
        other = MXFP4_EXPERT_TENSORS if not self.mxfp4 else EXPERT_TENSORS
        if key in other:
            raise ValueError("is an MXFP4 tensor, but config.json declares no quantization_config"
                             " 'mxfp4'" if not self.mxfp4 else
                             "is a float matrix, but config.json's quantization_config declares "
                             "MXFP4 experts (its _blocks and _scales)")
        return None

    def check_checkpoint_dtype(self, key: str, dtype: str) -> None:
        """ValueError when checkpoint tensor `key` (one `checkpoint_placements` placed) has a
        safetensors dtype its parameter cannot take: MXFP4 blocks and scales are U8, every
        other expert tensor a float."""
        packed = key.endswith(("_blocks", "_scales"))
        if packed and dtype != "U8":
            raise ValueError(f"has dtype {dtype}; MXFP4 blocks and scales are stored as U8")
        if not packed and dtype not in FLOAT_DTYPES:
            raise ValueError(f"has dtype {dtype}; it holds float weights "
                             f"({', '.join(FLOAT_DTYPES)})")


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
