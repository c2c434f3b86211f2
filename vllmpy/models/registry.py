"""Architecture name -> (config converter, model class), imported on first use.

Keys are config.json ``architectures`` entries. Each entry names the module under
``vllmpy.models`` that holds the architecture's typed config (its ``from_hf`` converter)
and its model class, and, where llama.cpp defines the architecture, its GGUF
``general.architecture`` name (the module then also provides ``GGUF_ARCH``, see
``vllmpy.loader.gguf_arch``). Adding a family is one new model file and one line here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from torch import nn

from vllmpy.config import ConfigError, TextModelConfig


@dataclass(frozen=True)
class ModelEntry:
    module: str  # vllmpy.models.<module>
    config: str  # its TextModelConfig subclass, with ``from_hf(cfg, architecture)``
    model: str  # its model class
    gguf: str | None = None  # llama.cpp's general.architecture, when it loads from GGUF


_MODELS: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry("llama", "LlamaConfig", "LlamaForCausalLM", gguf="llama"),
    "MistralForCausalLM": ModelEntry("llama", "LlamaConfig", "LlamaForCausalLM"),
    "MixtralForCausalLM": ModelEntry("mixtral", "MixtralConfig", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ModelEntry("qwen2", "Qwen2Config", "LlamaForCausalLM", gguf="qwen2"),
    "Qwen3ForCausalLM": ModelEntry("qwen3", "Qwen3Config", "Qwen3ForCausalLM", gguf="qwen3"),
    "Qwen2MoeForCausalLM": ModelEntry("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                                      gguf="qwen2moe"),
    "Qwen3MoeForCausalLM": ModelEntry("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                      gguf="qwen3moe"),
    "OlmoeForCausalLM": ModelEntry("olmoe", "OlmoeConfig", "OlmoeForCausalLM", gguf="olmoe"),
    "GptOssForCausalLM": ModelEntry("gpt_oss", "GptOssConfig", "GptOssForCausalLM"),
    "GraniteMoeForCausalLM": ModelEntry("granite_moe", "GraniteMoeConfig",
                                        "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ModelEntry("granite_moe", "GraniteMoeConfig",
                                              "GraniteMoeForCausalLM"),
    "PhimoeForCausalLM": ModelEntry("phimoe", "PhimoeConfig", "PhimoeForCausalLM"),
    "GPT2LMHeadModel": ModelEntry("gpt2", "GPT2Config", "GPT2LMHeadModel", gguf="gpt2"),
    "OPTForCausalLM": ModelEntry("opt", "OPTConfig", "OPTForCausalLM"),
    "GPTNeoXForCausalLM": ModelEntry("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "StableLmForCausalLM": ModelEntry("stablelm", "StableLmConfig", "StableLmForCausalLM",
                                      gguf="stablelm"),
    "Starcoder2ForCausalLM": ModelEntry("starcoder2", "Starcoder2Config",
                                        "Starcoder2ForCausalLM", gguf="starcoder2"),
    "CohereForCausalLM": ModelEntry("cohere", "CohereConfig", "CohereForCausalLM",
                                    gguf="command-r"),
    "Cohere2ForCausalLM": ModelEntry("cohere", "CohereConfig", "CohereForCausalLM",
                                     gguf="cohere2"),
    "Gemma2ForCausalLM": ModelEntry("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
                                    gguf="gemma2"),
    "Gemma3ForCausalLM": ModelEntry("gemma3", "Gemma3Config", "Gemma3ForCausalLM",
                                    gguf="gemma3"),
    # the text model of the multimodal checkpoint (its vision tower is not loaded)
    "Gemma3ForConditionalGeneration": ModelEntry("gemma3", "Gemma3Config",
                                                 "Gemma3ForCausalLM"),
    "Gemma4ForCausalLM": ModelEntry("gemma4", "Gemma4Config", "Gemma4ForCausalLM"),
    # decoders with a classification head on the last token (rerankers, classifiers)
    "Qwen3ForSequenceClassification": ModelEntry("seq_cls", "Qwen3SeqClsConfig",
                                                 "Qwen3ForSequenceClassification"),
    "Qwen2ForSequenceClassification": ModelEntry("seq_cls", "Qwen2SeqClsConfig",
                                                 "LlamaForSequenceClassification"),
    "LlamaForSequenceClassification": ModelEntry("seq_cls", "LlamaSeqClsConfig",
                                                 "LlamaForSequenceClassification"),
    # EmbeddingGemma: Gemma 3 with bidirectional attention, an encoder for pooling
    "Gemma3TextModel": ModelEntry("gemma3_embedding", "Gemma3EncoderConfig",
                                  "Gemma3TextEncoder"),
    "Phi3ForCausalLM": ModelEntry("phi3", "Phi3Config", "Phi3ForCausalLM", gguf="phi3"),
    "Olmo2ForCausalLM": ModelEntry("olmo2", "Olmo2Config", "Olmo2ForCausalLM", gguf="olmo2"),
    "Olmo3ForCausalLM": ModelEntry("olmo3", "Olmo3Config", "Olmo2ForCausalLM"),
    "Exaone4ForCausalLM": ModelEntry("exaone4", "Exaone4Config", "Exaone4ForCausalLM"),
    "GraniteForCausalLM": ModelEntry("granite", "GraniteConfig", "GraniteForCausalLM"),
    "SmolLM3ForCausalLM": ModelEntry("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM"),
    "InternLM3ForCausalLM": ModelEntry("internlm3", "InternLM3Config", "LlamaForCausalLM"),
    # hybrid and latent-attention models: recurrent-state seats and MLA latents
    # (vllmpy.core.cache_spec)
    "Mamba2ForCausalLM": ModelEntry("mamba2", "Mamba2Config", "Mamba2ForCausalLM"),
    "NemotronHForCausalLM": ModelEntry("nemotron_h", "NemotronHConfig",
                                       "NemotronHForCausalLM"),
    "GraniteMoeHybridForCausalLM": ModelEntry("granite_moe_hybrid", "GraniteMoeHybridConfig",
                                              "GraniteMoeHybridForCausalLM"),
    "FalconH1ForCausalLM": ModelEntry("falcon_h1", "FalconH1Config", "FalconH1ForCausalLM"),
    "Qwen3NextForCausalLM": ModelEntry("qwen3_next", "Qwen3NextConfig",
                                       "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ModelEntry("qwen3_next", "Qwen3_5Config", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ModelEntry("qwen3_next", "Qwen3_5MoeConfig",
                                        "Qwen3NextForCausalLM"),
    "DeepseekV2ForCausalLM": ModelEntry("deepseek_v2", "DeepseekV2Config",
                                        "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ModelEntry("deepseek_v2", "DeepseekV3Config",
                                        "DeepseekV2ForCausalLM"),
    # encoder-only models: the pooling runner (embeddings, classification, scores)
    "BertModel": ModelEntry("bert", "BertConfig", "BertModel"),
    "BertForMaskedLM": ModelEntry("bert", "BertConfig", "BertModel"),
    "BertForSequenceClassification": ModelEntry("bert", "BertConfig",
                                                "BertForSequenceClassification"),
    "RobertaModel": ModelEntry("bert", "BertConfig", "BertModel"),
    "XLMRobertaModel": ModelEntry("bert", "BertConfig", "BertModel"),
    "RobertaForSequenceClassification": ModelEntry("bert", "BertConfig",
                                                   "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ModelEntry("bert", "BertConfig",
                                                      "RobertaForSequenceClassification"),
    "MPNetModel": ModelEntry("mpnet", "MPNetConfig", "MPNetModel"),
    "MPNetForMaskedLM": ModelEntry("mpnet", "MPNetConfig", "MPNetModel"),
    "NomicBertModel": ModelEntry("nomic_bert", "NomicBertConfig", "NomicBertModel",
                                 gguf="nomic-bert"),
}


class UnsupportedArchitectureError(ConfigError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def gguf_architectures() -> dict[str, str]:
    """GGUF general.architecture -> the Hugging Face architecture it loads as."""
    return {e.gguf: arch for arch, e in _MODELS.items() if e.gguf is not None}


def _entry(architectures: list[str]) -> tuple[str, ModelEntry]:
    for arch in architectures:
        if arch in _MODELS:
            return arch, _MODELS[arch]
    raise UnsupportedArchitectureError(
        f"architecture {architectures} is not supported; supported: "
        f"{', '.join(supported_architectures())}")


def _module(entry: ModelEntry) -> Any:
    return importlib.import_module(f"vllmpy.models.{entry.module}")


def text_config(hf_config: dict[str, Any]) -> TextModelConfig:
    """The architecture's own typed config from a config.json dict. The architecture is
    resolved first, so an unsupported one is named before any field is read."""
    archs = hf_config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"model config has no usable 'architectures' entry (got {archs!r}); "
                          "it names the model class, e.g. [\"LlamaForCausalLM\"]")
    arch, entry = _entry(archs)
    config_cls = getattr(_module(entry), entry.config)
    return config_cls.from_hf(hf_config, arch)


def resolve_model_class(architectures: list[str]) -> type[nn.Module]:
    _, entry = _entry(architectures)
    return getattr(_module(entry), entry.model)


def gguf_module(gguf_architecture: str) -> Any | None:
    """The model module of a GGUF ``general.architecture`` name, or None."""
    arch = gguf_architectures().get(gguf_architecture)
    return None if arch is None else _module(_MODELS[arch])
