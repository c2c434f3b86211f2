"""``mtp`` / ``deepseek_mtp``: the target checkpoint's own multi-token-prediction layer
(``vllmpy.models.deepseek_mtp``) proposes the drafts, greedily, one forward per draft.

It works as an EAGLE head does (``vllmpy.spec_decode.eagle``): it reads the target's hidden
state at position p and the embedding of the token at p + 1, keeps its KV (one MLA latent
cache) on the target's block table, runs after every step while that step's hidden states
are at hand, and drafts k times, reusing its one layer past the checkpoint's
``num_nextn_predict_layers`` (as vLLM does). Its weights are the checkpoint's
``model.layers.{num_hidden_layers}.*`` tensors, read from the target's own files; nothing
else of the checkpoint is read again.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vllmpy.config import ConfigError, log
from vllmpy.layers.custom_op import bind_ops
from vllmpy.layers.quantization import quantize_model
from vllmpy.loader.load_stats import LoadStats
from vllmpy.loader.materialize import materialize
from vllmpy.loader.source import ModelSource
from vllmpy.models.deepseek_mtp import (
    MTP_TARGETS,
    DeepseekMTP,
    DeepseekMTPConfig,
    mtp_checkpoint_weights,
    mtp_tensor_names,
)
from vllmpy.models.deepseek_v2 import DeepseekV3Config
from vllmpy.spec_decode.config import FLAG, SpeculativeConfig
from vllmpy.spec_decode.eagle import EagleProposer


def _check_target(config: SpeculativeConfig, target_text: Any) -> DeepseekV3Config:
    where = f"{FLAG}: method {config.method!r}"
    arch = (target_text.architectures or [None])[0]
    if arch not in MTP_TARGETS or not isinstance(target_text, DeepseekV3Config):
        raise ConfigError(f"{where} reads the multi-token-prediction layers of the target's "
                          f"checkpoint; the target is {arch}, which has none this engine "
                          f"builds (supported: {', '.join(MTP_TARGETS)}); use method "
                          f"'eagle' with a head, 'draft_model' or 'ngram' instead")
    if target_text.num_nextn_predict_layers < 1:
        raise ConfigError(f"{where}: the target's config has no MTP layers "
                          f"(num_nextn_predict_layers "
                          f"{target_text.num_nextn_predict_layers}); use a checkpoint that "
                          f"ships them, or another method")
    return target_text


def kv_config(config: SpeculativeConfig, target_source_kind: str,
              target_text: Any) -> DeepseekMTPConfig:
    """The MTP layer's one MLA latent cache (its MLP kind does not change the cache)."""
    target = _check_target(config, target_text)
    if target_source_kind not in ("hf_dir", "dummy"):
        raise ConfigError(f"{FLAG}: method {config.method!r} loads the MTP layer from a "
                          f"Hugging Face directory (safetensors), not a "
                          f"{target_source_kind} file")
    return DeepseekMTPConfig.of_target(target, sparse=any(target.sparse_layers))


def _same_checkpoint(named: str, mc: Any) -> bool:
    return named in (mc.model, mc.path) or (
        os.path.exists(named) and os.path.realpath(named) == os.path.realpath(mc.path))


def head_config(config: SpeculativeConfig, mc: Any) -> DeepseekMTPConfig:
    """The MTP layer's config: the target's, at the layer's index (dense or MoE), with the
    embeddings and LM head the checkpoint carries for it."""
    from vllmpy.models.registry import text_config

    target = _check_target(config, mc.text_config)
    if config.model is not None and not _same_checkpoint(config.model, mc):
        raise ConfigError(f"{FLAG}: method {config.method!r} reads the MTP layers of the "
                          f"target's own checkpoint ({mc.model}); its model names another, "
                          f"{config.model!r}: leave model out (or name the target)")
    n = target.num_hidden_layers
    # the MTP layer is layer n of the same stack: as many layers read, its own MLP kind
    stack = text_config({**mc.hf_config, "num_hidden_layers": n + 1})
    assert isinstance(stack, DeepseekV3Config)
    sparse = stack.sparse_layers[n]
    has_embed = has_head = False
    if mc.source_kind == "hf_dir":
        names = mtp_tensor_names(mc.path, n)
        if not any(name.startswith("eh_proj.") for name in names):
            raise ConfigError(f"{FLAG}: method {config.method!r}: the target's config says "
                              f"num_nextn_predict_layers {target.num_nextn_predict_layers}, "
                              f"but its checkpoint {mc.path} has no model.layers.{n}.eh_proj "
                              f"(its MTP layer); use a checkpoint that ships the MTP "
                              f"layers, or another method")
        has_embed = "embed_tokens.weight" in names
        has_head = "shared_head.head.weight" in names
    return DeepseekMTPConfig.of_target(target, sparse, has_embed, has_head)


class MTPProposer(EagleProposer):
    """An EAGLE proposer whose head is the target checkpoint's MTP layer."""

    def __init__(self, config: SpeculativeConfig, runner: Any) -> None:
        mc = runner.config.model
        text = head_config(config, mc)
        source = ModelSource(mc.model, mc.source_kind, mc.path, mc.hf_config,
                             set(mc.eos_token_ids))
        seconds = self._load(config, runner, source, text, "MTP layer", DeepseekMTP)
        assert isinstance(self.model, DeepseekMTP)
        self.model.share(runner.model)
        shared = [what for what, own in (("embeddings", text.has_embed_tokens),
                                         ("LM head", text.has_lm_head)) if not own]
        mlp = "MoE" if text.sparse_layers[0] else "dense"
        uses = f", the target's {' and '.join(shared)}" if shared else ""
        log(f"speculative decoding: MTP layer model.layers.{text.mtp_layer} loaded ({mlp} "
            f"MLP{uses}) in {seconds:.2f} s")
        self._observed = None
        self._aux = None

    def _build(self, source: ModelSource, text: Any, quant: Any, stats: LoadStats,
               model_cls: Any) -> Any:
        """Built as the runner builds a model, loaded from the checkpoint's MTP tensors
        alone (random weights for a dummy target)."""
        runner = self.runner
        if source.kind == "dummy":
            return runner.build_model(source, text, quant, stats, model_cls=model_cls)
        dtype = runner.config.model.dtype
        with stats.phase("build"):
            with torch.device("meta"):
                model = model_cls(text)
                quantize_model(model, quant)
            materialize(model, runner.device, dtype)
            bind_ops(model, runner.device)
        with stats.phase("weights"):
            model.load_weights(mtp_checkpoint_weights(source.path, text.mtp_layer, dtype))
        return model.eval()

    def initialize_kv_cache(self) -> None:
        """The MTP layer's latent cache on the target's blocks (the runner binds only the
        target's layers)."""
        cache = self.runner.config.cache
        layers = [m for m in self.model.modules() if callable(getattr(m, "cache_spec", None))]
        self.kv_caches = [torch.zeros(m.cache_spec().cache_shape(cache.num_blocks,
                                                                 cache.block_size),
                                      dtype=cache.kv_cache_dtype, device=self.runner.device)
                          for m in layers]
        for layer, kv in zip(layers, self.kv_caches):
            layer.bind(kv)


def make(config: SpeculativeConfig, runner: Any) -> MTPProposer:
    return MTPProposer(config, runner)
