"""Architecture name -> model class, imported on first use.

Keys are config.json ``architectures`` entries; GGUF files are mapped to the same names
by the GGUF loader from ``general.architecture``. Qwen2 is the Llama layout with q/k/v
biases (the config converter sets ``attention_bias``), so it shares Llama's implementation;
Mistral likewise.
"""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("vllmpy.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("vllmpy.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("vllmpy.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("vllmpy.models.qwen3", "Qwen3ForCausalLM"),
}


class UnsupportedArchitectureError(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str]) -> type[nn.Module]:
    for arch in architectures:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise UnsupportedArchitectureError(
        f"architecture {architectures} is not supported; supported: "
        f"{', '.join(supported_architectures())}")
