"""Mistral: the Llama architecture with grouped-query attention and a sliding window.

Paged sliding-window attention is not implemented; the loader instead caps max_model_len at the
window, within which full causal attention and sliding-window attention agree exactly.
"""

from __future__ import annotations

from executor_svc.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Same modules and checkpoint keys as Llama."""
