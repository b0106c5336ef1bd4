"""Model registry: HF ``architectures[0]`` -> model class, imported only when asked for."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name -> (module, class name); modules are imported lazily.
_REGISTRY: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": ("executor_svc.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("executor_svc.models.gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("executor_svc.models.gpt_oss", "GptOssForCausalLM"),
    "LlamaForCausalLM": ("executor_svc.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("executor_svc.models.mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("executor_svc.models.mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("executor_svc.models.phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("executor_svc.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("executor_svc.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("executor_svc.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("executor_svc.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str) -> type[nn.Module]:
    try:
        module_name, class_name = _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"model architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(supported_architectures())}") from None
    return getattr(importlib.import_module(module_name), class_name)
