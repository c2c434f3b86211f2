"""Decoder LMs as sequence classifiers and rerankers (``*ForSequenceClassification``): the
causal LM's last token's final state, through a classification head.

The head is either the checkpoint's ``score`` [num_labels, hidden] (transformers'
``Qwen3ForSequenceClassification`` and kin), or, with ``classifier_from_token`` (set by
``--hf-overrides``, as vLLM takes it), rows of the LM head: the logits of those tokens.
With ``is_original_qwen3_reranker`` and the two tokens ``["no", "yes"]``, Qwen3-Reranker's
yes/no form, the one label is ``logit(yes) - logit(no)``, so that its sigmoid is the
reranker's P(yes) over {no, yes}. The tokens' ids are resolved from the tokenizer before
the config is read (``classifier_token_ids``).

Each family is two lines at the bottom: its config and its model class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from vllmpy.config import ConfigError
from vllmpy.layers.linear import Linear
from vllmpy.models.llama import LlamaConfig, LlamaForCausalLM
from vllmpy.models.qwen2 import Qwen2Config
from vllmpy.models.qwen3 import Qwen3Config, Qwen3ForCausalLM


def seq_cls_config(base: type) -> type:
    """``base``'s config with the classification head's settings."""

    @dataclasses.dataclass(frozen=True)
    class SeqClsConfig(base):  # type: ignore[valid-type, misc]
        num_labels: int = 2
        classifier_token_ids: tuple[int, ...] | None = None
        original_qwen3_reranker: bool = False

        @classmethod
        def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Any:
            inner = base.from_hf(cfg, architecture)
            ids = cfg.get("classifier_token_ids")
            labels = cfg.get("id2label")
            num = len(ids) if ids else int(cfg.get("num_labels") or (len(labels) if labels
                                                                      else 2))
            original = bool(cfg.get("is_original_qwen3_reranker", False))
            if original and (not ids or len(ids) != 2):
                raise ConfigError(f"{architecture}: is_original_qwen3_reranker needs "
                                  f"classifier_from_token of two tokens (['no', 'yes'])")
            fields = {f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)}
            return cls(**fields, num_labels=1 if original else num,
                       classifier_token_ids=tuple(ids) if ids else None,
                       original_qwen3_reranker=original)

    SeqClsConfig.__name__ = SeqClsConfig.__qualname__ = f"{base.__name__}ForSeqCls"
    return SeqClsConfig


def seq_cls_model(base: type) -> type:
    """``base`` (a causal LM) with a classification head on its last token."""

    class ForSequenceClassification(base):  # type: ignore[valid-type, misc]
        default_pooling_type = "LAST"

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.num_labels = config.num_labels
            self.token_ids = config.classifier_token_ids
            self.score = None
            if self.token_ids is None:
                self.score = Linear(config.hidden_size, config.num_labels)
                self.lm_head = None  # a classification checkpoint has no LM head

        def classify(self, pooled: torch.Tensor) -> torch.Tensor:
            if self.score is not None:
                return self.score(pooled)
            ids = torch.as_tensor(self.token_ids, device=pooled.device)
            logits = self.compute_logits(pooled).index_select(1, ids).float()
            if self.config.original_qwen3_reranker:  # logit(yes) - logit(no)
                return logits[:, 1:2] - logits[:, 0:1]
            return logits

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            if self.score is None:  # the LM head's rows are the classifier
                return super().load_weights((n, t) for n, t in weights
                                            if not n.startswith("score."))
            # a classification checkpoint carries no LM head; the tied one stays unused
            return super().load_weights(weights)

    ForSequenceClassification.__name__ = base.__name__.replace("ForCausalLM",
                                                               "ForSequenceClassification")
    return ForSequenceClassification


Qwen3SeqClsConfig = seq_cls_config(Qwen3Config)
Qwen3ForSequenceClassification = seq_cls_model(Qwen3ForCausalLM)
Qwen2SeqClsConfig = seq_cls_config(Qwen2Config)
LlamaSeqClsConfig = seq_cls_config(LlamaConfig)
LlamaForSequenceClassification = seq_cls_model(LlamaForCausalLM)
