"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft head, in the layout of the
target's own checkpoint.

MTP layer i is stored as decoder layer ``model.layers.{num_hidden_layers + i}.``:
``enorm`` (RMSNorm of the next token's embedding), ``hnorm`` (RMSNorm of the target's
hidden state), ``eh_proj`` (2H -> H over ``[enorm(emb), hnorm(hidden)]``), a whole decoder
layer under the same prefix (MLA ``self_attn``, ``mlp`` MoE or dense as the layer's index
says, ``input_layernorm``, ``post_attention_layernorm``), ``shared_head.norm`` and
``shared_head.head`` (the LM head) and ``embed_tokens``. The last two are copies of the
target's in DeepSeek's release; a checkpoint without them uses the target's (``share``).

At position p the head reads the target's hidden state at p (what the target's forward
returns, after its final norm) and the embedding of the token at p + 1; its output
(before ``shared_head.norm``) is both what the LM head reads, after that norm, and the
hidden state of the next draft. As vLLM does, the embedding at position 0 is zeroed, and
only the first MTP layer is built: it proposes every draft.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.deepseek_v2 import PACKED_GATE_UP, DeepseekV2DecoderLayer, DeepseekV3Config
from vllmpy.models.weights import load_packed_weights

# the target architectures whose checkpoints carry MTP layers this head builds
MTP_TARGETS = ("DeepseekV3ForCausalLM",)
# checkpoint names of an MTP layer's own modules (the rest is its decoder layer's)
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


@dataclass(frozen=True)
class DeepseekMTPConfig(DeepseekV3Config):
    """The target's config narrowed to the one MTP layer built: ``num_hidden_layers`` 1,
    ``sparse_layers`` that layer's MLP kind; so ``layer_cache_specs`` is its one MLASpec."""

    mtp_layer: int = 0  # its checkpoint index (the target's num_hidden_layers)
    # whether the checkpoint carries these (else the target's are used)
    has_embed_tokens: bool = False
    has_lm_head: bool = False

    @classmethod
    def of_target(cls, target: DeepseekV3Config, sparse: bool, has_embed_tokens: bool = False,
                  has_lm_head: bool = False) -> DeepseekMTPConfig:
        fields = {f.name: getattr(target, f.name) for f in dataclasses.fields(target)}
        fields.update(num_hidden_layers=1, sparse_layers=(sparse,), layer_windows=(None,),
                      mtp_layer=target.num_hidden_layers, has_embed_tokens=has_embed_tokens,
                      has_lm_head=has_lm_head)
        return cls(**fields)


class SharedHead(nn.Module):
    def __init__(self, config: DeepseekMTPConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = (Linear(config.hidden_size, config.vocab_size)
                     if config.has_lm_head else None)


class DeepseekMTP(nn.Module):
    """The head over the flattened tokens of one draft forward (the EagleHead contract:
    ``combine``, ``forward`` -> (states the LM head reads, states the next draft reads),
    ``draft_ids``, ``share``)."""

    def __init__(self, config: DeepseekMTPConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = (VocabEmbedding(config.vocab_size, h)
                             if config.has_embed_tokens else None)
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        self.mtp_block = DeepseekV2DecoderLayer(config, 0)
        self.shared_head = SharedHead(config)
        self._target: list[Any] = []  # the target model, for what the head shares

    def share(self, target: Any) -> None:
        """Use the target's embeddings and LM head where the checkpoint has none."""
        self._target = [target]

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self._target[0].model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, attn_metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self._embed(input_ids)  # [num_tokens, hidden_size]
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden_states)], dim=-1))
        x, residual = self.mtp_block(positions, x, None, attn_metadata)
        out = x + residual
        return out, out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = self.shared_head.norm(hidden_states)
        if self.shared_head.head is None:
            return self._target[0].compute_logits(normed)
        return head_logits(self.shared_head.head, None, normed)  # type: ignore[arg-type]

    def draft_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The greedy draft after each row."""
        return self.compute_logits(hidden_states).float().argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's ``model.layers.{mtp_layer}.*`` tensors (any other is skipped):
        the decoder layer's go to ``mtp_block``."""
        prefix = f"model.layers.{self.config.mtp_layer}."

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(prefix):
                    continue
                name = name[len(prefix):]
                if name.startswith("embed_tokens.") and self.embed_tokens is None:
                    continue
                if name.startswith("shared_head.head.") and self.shared_head.head is None:
                    continue
                yield (name if name.startswith(_OWN) else f"mtp_block.{name}"), tensor

        return load_packed_weights(self, renamed(), PACKED_GATE_UP, ("rotary_emb.inv_freq",))


def mtp_tensor_names(model_dir: str | os.PathLike[str], layer: int) -> set[str]:
    """The names under ``model.layers.{layer}.`` in a checkpoint's safetensors, with that
    prefix removed (headers only)."""
    from safetensors import safe_open

    from vllmpy.loader.safetensors_loader import safetensors_files

    prefix = f"model.layers.{layer}."
    names: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            names.update(n[len(prefix):] for n in f.keys() if n.startswith(prefix))  # noqa: SIM118
    return names


def mtp_checkpoint_weights(model_dir: str | os.PathLike[str], layer: int,
                           dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint's ``model.layers.{layer}.*`` tensors only, floating
    ones cast to ``dtype``: the rest of the checkpoint is never read."""
    from safetensors import safe_open

    from vllmpy.loader.safetensors_loader import (
        FLOAT_DTYPES,
        check_safetensors_headers,
        safetensors_files,
    )

    prefix = f"model.layers.{layer}."
    files = safetensors_files(model_dir)
    check_safetensors_headers(files)
    floating = set(FLOAT_DTYPES.values())
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                if name.startswith(prefix):
                    tensor = f.get_tensor(name)
                    yield name, tensor.to(dtype) if tensor.dtype in floating else tensor
