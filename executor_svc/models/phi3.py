"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama architecture with fused checkpoint tensors.

The checkpoint stores ``self_attn.qkv_proj.weight`` (q|k|v rows) and ``mlp.gate_up_proj.weight``
(gate|up rows) already stacked, in exactly the layout of Folio's fused layers; the loader fills
each part of them from its rows (models/parallel.py `prefused_shard`), so a tensor-parallel rank
still reads only its own heads and MLP columns. LongRoPE (``rope_scaling`` type longrope, or
its old names su / yarn in Phi-3 configs) comes from checkpoints/rope.py; ``sliding_window`` is
read as Mistral's is (the loader caps max_model_len at it). ``partial_rotary_factor`` below 1
(Phi-4-mini's 0.75) is the config's rotary_dim: LlamaAttention rotates each head's first
rotary_dim dimensions and passes the rest through, as HF's Phi-3 does.
"""

from __future__ import annotations

from executor_svc.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Same modules as Llama: qkv_proj and gate_up_proj are both the checkpoint's and ours."""
