"""Tiny random HF checkpoints per architecture, and a minimal scheduler stand-in that drives
our model over the paged KV cache with real step plans. HF transformers is the oracle."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from executor_svc.kv.host_tier import map_tier_file, open_tier_file, tier_identity
from executor_svc.kv.kv_cache import KVCache
from executor_svc.kv.kv_scales import default_scales
from executor_svc.kv.swap import SwapPool
from executor_svc.loading.loader import effective_max_model_len, load_model
from executor_svc.loading.model_config import ModelConfig
from executor_svc.step.runner import ModelRunner
from executor_svc.worker import kv_dtype_name
from protos.plan import CachedRequest, NewRequest, SamplingSpec, StepPlan

BLOCK_SIZE = 4  # small, so prompts span several blocks
NUM_BLOCKS = 96

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
               max_position_embeddings=256, rms_norm_eps=1e-6,
               # Random models have near-tied logits; a wider init separates them.
               initializer_range=0.1)

# name -> (HF config class name, HF model class name, config overrides)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64))),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=4,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    # A window of 8 on every layer: the test prompts and their continuations cross it.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8,
                                                            tie_word_embeddings=False)),
    # Fused qkv_proj / gate_up_proj checkpoint tensors; LongRoPE whose original context (64)
    # the tests' sequences stay within: HF's Phi-3 generate re-encodes a sequence with the long
    # factors once it passes it (tests/executor/models/test_phi3.py covers that case).
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=False, original_max_position_embeddings=64, pad_token_id=0,
        eos_token_id=2,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                             short_factor=[1.0 + 0.05 * i for i in range(8)],
                             long_factor=[1.0 + 0.6 * i for i in range(8)]))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # Layers 1 and 2 (from max_window_layers on) slide over 12 tokens, layer 0 is full.
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=12, max_window_layers=1,
        tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    # Sliding (window 10) and full layers alternate; both softcaps small enough to bite;
    # query_pre_attn_scalar != head_dim.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=10,
        attn_logit_softcapping=3.0, final_logit_softcapping=4.0)),
    # Two sliding layers (window 12) per full one; the local layers' base (100) is not the
    # global one's, which is scaled (linear, factor 2).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=16, sliding_window=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}},
        final_logit_softcapping=6.0)),
    # Mixture of experts: 8 experts of intermediate_size, top-2 renormalised, every layer.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    # 6 experts, top-2 not renormalised, a gated shared expert; q/k/v biases.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False)),
    # 8 experts, top-2 renormalised, a dense MLP (intermediate_size) on layer 1 of 3.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        tie_word_embeddings=True)),
    # gpt-oss: 4 experts, top-2 (top-k of the logits, then a softmax over those), biased
    # experts with the clamped SwiGLU (a limit low enough to clamp), attention sinks, layers
    # alternating a 16-token window and full attention, YaRN over an original context of 64.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=16, swiglu_limit=1.5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=64))),
}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
# gpt-oss's checkpoint with its experts rewritten as random MXFP4 blocks and scales (conftest's
# checkpoint_cache; its HF model is HF's own load of the rewritten files).
MXFP4_ARCH = "gpt_oss_mxfp4"


def make_hf_model(arch: str, **overrides):
    import transformers

    config_cls, model_cls, arch_overrides = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**_COMMON, **arch_overrides, **overrides})
    torch.manual_seed(sum(map(ord, arch)))
    model = getattr(transformers, model_cls)(config).eval()
    if arch in ("qwen2", "qwen2_moe"):
        # HF inits biases at zero; give them values so a dropped bias would show.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    if proj.bias is not None:  # qwen2_moe with qkv_bias false
                        proj.bias.normal_(0, 0.5)
    if arch in ("qwen3", "qwen3_moe"):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    if arch.startswith("gemma"):
        randomize_gemma_norms(model)
    if arch == "gpt_oss":
        randomize_gpt_oss(model)
    return model


def randomize_gpt_oss(model) -> None:
    """HF inits gpt-oss's biases at zero and its sinks near it; give them values so a dropped
    bias, a lost sink or a sink of the wrong head would show."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn, experts = layer.self_attn, layer.mlp.experts
            attn.sinks.normal_(0, 1.0)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.normal_(0, 0.3)
            experts.gate_up_proj_bias.normal_(0, 0.5)
            experts.down_proj_bias.normal_(0, 0.3)


def randomize_gemma_norms(model) -> None:
    """HF inits Gemma's (1 + w) norms at w = 0; give them values so a lost 1 (or a 1 added
    twice) would show."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)


def save_checkpoint(model, path: Path, **save_kwargs) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **save_kwargs)
    return path


def make_runner(model_dir: Path, num_blocks: int = NUM_BLOCKS, num_swap_blocks: int = 0,
                keep_plain_weights: bool = False,
                device: torch.device = torch.device("cpu"),  # noqa: B008
                num_host_blocks: int = 0, tier_file: Path | None = None,
                kv_dtype: torch.dtype = torch.float32) -> ModelRunner:
    """A float32 runner over a `kv_dtype` cache (float32, fp8 with the default scales of 1.0,
    or int8); with `tier_file`, its host tier of `num_host_blocks` blocks lives in that tier
    file (opened if it holds this model's blocks, else created)."""
    cfg = ModelConfig.from_dir(model_dir)
    max_len = effective_max_model_len(cfg, None)
    model = load_model(model_dir, dtype=torch.float32, device=device, max_model_len=max_len,
                       cfg=cfg, keep_plain_weights=keep_plain_weights)
    scales = default_scales(cfg, 1) if kv_dtype == torch.float8_e4m3fn else None
    kv_cache = KVCache.allocate(cfg, num_blocks, BLOCK_SIZE, kv_dtype, device, scales)
    kv_cache.bind(model)
    swap_pool = SwapPool.allocate(kv_cache, num_swap_blocks) if num_swap_blocks else None
    host_tier = SwapPool.allocate(kv_cache, num_host_blocks) if num_host_blocks else None
    records = None
    if tier_file is not None:
        tier = open_tier_file(tier_file, tier_identity(
            model_name=model_dir.name, architecture=cfg.architecture,
            kv_dtype_name=kv_dtype_name(kv_dtype), kv_cache=kv_cache, block_size=BLOCK_SIZE,
            num_slots=num_host_blocks, tensor_parallel_size=1))
        host_tier, records = map_tier_file(tier, kv_cache, rank=0)
    return ModelRunner(model, kv_cache, BLOCK_SIZE, max_len, cfg.vocab_size, device, swap_pool,
                       host_tier=host_tier, host_tier_records=records)


class PlanDriver:
    """Plays a minimal scheduler: hands out shuffled block ids, chunks prompts, decodes.
    With KV groups (`num_kv_groups`, the runner's `kv_cache.layout.num_groups`) a position
    takes one block per group, interleaved; nothing is released."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, seed: int = 0, num_kv_groups: int = 1):
        self.num_kv_groups = num_kv_groups
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_ids: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}  # tokens the request holds
        self.num_computed: dict[str, int] = {}
        self.step_id = 0

    def _grow(self, req_id: str, upto: int) -> list[int]:
        need = self.num_kv_groups * -(-upto // BLOCK_SIZE) - len(self.block_ids[req_id])
        new = [self.free.pop() for _ in range(max(need, 0))]
        self.block_ids[req_id].extend(new)
        return new

    def new(self, req_id: str, token_ids: list[int], num_scheduled: int,
            sampling: SamplingSpec | None = None) -> NewRequest:
        self.block_ids[req_id] = []
        self._grow(req_id, num_scheduled)
        self.num_tokens[req_id] = len(token_ids)
        self.num_computed[req_id] = num_scheduled
        return NewRequest(req_id=req_id, token_ids=list(token_ids),
                          sampling=sampling or SamplingSpec(temperature=0.0),
                          block_ids=list(self.block_ids[req_id]), num_computed_tokens=0,
                          num_scheduled_tokens=num_scheduled)

    def cached(self, req_id: str, num_scheduled: int) -> CachedRequest:
        computed = self.num_computed[req_id]
        new = self._grow(req_id, computed + num_scheduled)
        self.num_computed[req_id] = computed + num_scheduled
        return CachedRequest(req_id=req_id, new_block_ids=new, num_computed_tokens=computed,
                             num_scheduled_tokens=num_scheduled)

    def swap_out(self, req_id: str, cpu_ids: list[int]) -> list[tuple[int, int]]:
        """(device, cpu) pairs for all of the request's blocks; its device blocks go back to the
        free list's end, so the next blocks handed out are exactly these."""
        pairs = list(zip(self.block_ids[req_id], cpu_ids, strict=True))
        self.free.extend(reversed(self.block_ids[req_id]))
        self.block_ids[req_id] = []
        return pairs

    def swap_in(self, req_id: str, cpu_ids: list[int], token_ids: list[int],
                sampling: SamplingSpec | None = None) -> tuple[list[tuple[int, int]], NewRequest]:
        """(cpu, device) pairs onto fresh device blocks, and the NewRequest that resumes the
        request with its KV in place: all its tokens, num_computed = all but the last."""
        self.block_ids[req_id] = [self.free.pop() for _ in cpu_ids]
        pairs = list(zip(cpu_ids, self.block_ids[req_id], strict=True))
        self._grow(req_id, len(token_ids))  # the last token may need a block of its own
        self.num_tokens[req_id] = len(token_ids)
        self.num_computed[req_id] = len(token_ids)
        new = NewRequest(req_id=req_id, token_ids=list(token_ids),
                         sampling=sampling or SamplingSpec(temperature=0.0),
                         block_ids=list(self.block_ids[req_id]),
                         num_computed_tokens=len(token_ids) - 1, num_scheduled_tokens=1)
        return pairs, new

    def decode_all(self, req_ids: list[str]) -> list[CachedRequest]:
        return [self.cached(r, self.num_tokens[r] - self.num_computed[r]) for r in req_ids]

    def plan(self, **kwargs) -> StepPlan:
        plan = StepPlan(step_id=self.step_id, **kwargs)
        self.step_id += 1
        return plan

    def record(self, sampled: list[tuple[str, list[int]]]) -> None:
        for req_id, ids in sampled:
            self.num_tokens[req_id] += len(ids)


def hf_top_logprobs(hf_model, token_ids: list[int], k: int) -> tuple[list[int], torch.Tensor]:
    """The oracle for logprobs: HF's next-token logits, log_softmax in fp32, top-k."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0, -1]
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k)
    return ids.tolist(), values


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate, greedy, never stopping early at an EOS id."""
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=0)
    ids = out[0, len(prompt):].tolist()
    assert len(ids) == max_new_tokens
    return ids


def plain_expert_weights(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """An `Experts` layer's w13 [E, 2I, H] and w2 [E, H, I], read back from the CPU backend's
    slabs (kernels.cpu.PackedExperts) where those replaced them."""
    packed = getattr(experts, "packed", None)
    if packed is None:
        return experts.w13, experts.w2
    plain = [packed.expert(e) for e in range(packed.num_experts)]
    return torch.stack([p[0] for p in plain]), torch.stack([p[1] for p in plain])
