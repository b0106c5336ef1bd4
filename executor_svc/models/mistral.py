"""Mistral: the Llama architecture with grouped-query attention and a sliding window.

``sliding_window`` applies to every layer (`ModelConfig.layer_windows`; HF's Mistral ignores
layer_types), and the attention layers honour it through the paged-attention kernels, so
max_model_len is not capped at the window.
"""

from __future__ import annotations

from executor_svc.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same modules and checkpoint keys as Llama."""
