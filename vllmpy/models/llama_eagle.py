"""EAGLE and EAGLE-3 draft heads: Llama decoder layers that read the target model's hidden
states, in the checkpoint layouts vLLM and SGLang load.

EAGLE (``fc``, ``layers.N.*``): the input of position p is ``fc([embed(t[p+1]),
h[p]])``, h the target's last hidden state (after its final norm); the first layer has
no input norm; the output (no final norm) goes through the target's LM head and, for the
next draft, comes back as ``h``. ``add_para_norm`` (HASS) norms the two halves first.

EAGLE-3 (``fc``, ``midlayer.*`` or ``layers.N.*``, ``norm``, ``lm_head``, ``d2t``): the
target's hidden states at three of its layers are concatenated and ``fc`` maps them to
the head's width once; the first layer's attention reads ``[input_layernorm(embed),
hidden_norm(h)]`` (twice the width) while ``h`` (or, with ``norm_before_residual``, its
norm) is the residual; the output before the final norm comes back as ``h``. The head's
own ``lm_head`` covers ``draft_vocab_size`` tokens: draft id i is target id ``i +
d2t[i]``.

A head without its own ``embed_tokens`` (or, at the target's vocabulary, ``lm_head``)
uses the target's (``share``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError
from vllmpy.layers.attention import SelfAttention
from vllmpy.layers.embedding import VocabEmbedding
from vllmpy.layers.linear import Linear, PackedLinear
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import ConfigReader
from vllmpy.models.llama import LlamaConfig
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

# head architecture names -> whether it is an EAGLE-3 head (vLLM's names and the
# checkpoints' own; EAGLE-1 checkpoints call themselves LlamaForCausalLM)
HEAD_ARCHITECTURES = {
    "EagleLlamaForCausalLM": False,
    "Eagle3LlamaForCausalLM": True,
    "LlamaForCausalLMEagle3": True,
}


@dataclass(frozen=True)
class EagleConfig(LlamaConfig):
    eagle3: bool
    draft_vocab_size: int  # rows of the head's own lm_head (EAGLE-3)
    target_hidden_size: int  # width of each target hidden state read
    # EAGLE-3: the target layers whose input hidden states are read (None: the target's
    # default choice); whether it reads three of them (else the last hidden state only)
    aux_layer_ids: tuple[int, ...] | None
    use_aux_hidden_state: bool
    norm_before_residual: bool
    add_para_norm: bool
    # whether the checkpoint carries these (else the target's are used)
    has_embed_tokens: bool = False
    has_lm_head: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> EagleConfig:
        eagle3 = HEAD_ARCHITECTURES[architecture]
        base = LlamaConfig.from_hf(cfg, architecture)
        r = ConfigReader(cfg, architecture)
        eagle = cfg.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ConfigError(f"{architecture} config 'eagle_config' must be an object, "
                              f"got {eagle!r}")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (not isinstance(ids, list)
                                or not all(isinstance(i, int) for i in ids) or not ids):
            raise ConfigError(f"{architecture} config 'eagle_aux_hidden_state_layer_ids' "
                              f"must be a list of layer numbers, got {ids!r}")
        use_aux = bool(eagle.get("use_aux_hidden_state", True)) if eagle3 else False
        if ids is not None and use_aux and len(ids) != 3:
            raise ConfigError(f"{architecture} config 'eagle_aux_hidden_state_layer_ids' "
                              f"names {len(ids)} layers; an EAGLE-3 head reads 3")
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                   eagle3=eagle3,
                   draft_vocab_size=r.get("draft_vocab_size", base.vocab_size, int),
                   target_hidden_size=r.get("target_hidden_size", base.hidden_size, int),
                   aux_layer_ids=None if ids is None else tuple(ids),
                   use_aux_hidden_state=use_aux,
                   norm_before_residual=r.get("norm_before_residual", False, bool),
                   add_para_norm=r.get("add_para_norm", False, bool))


class EagleDecoderLayer(nn.Module):
    def __init__(self, config: EagleConfig, layer_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.first = layer_idx == 0
        self.eagle3 = config.eagle3
        self.norm_before_residual = config.norm_before_residual
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            rotary=rotary, qkv_bias=config.attention_bias, o_bias=config.o_proj_bias)
        if self.eagle3 and self.first:  # attention over [embeddings, hidden states]
            attn = self.self_attn
            self.self_attn.qkv_proj = PackedLinear(
                2 * h, {"q": attn.q_size, "k": attn.kv_size, "v": attn.kv_size},
                bias=config.attention_bias)
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = GatedMLP(h, config.intermediate_size, bias=config.mlp_bias)
        # EAGLE's first layer reads fc's output as it is
        self.input_layernorm = (None if self.first and not self.eagle3
                                else RMSNorm(h, config.rms_norm_eps))
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor,
                hidden_states: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.eagle3 and self.first:
            assert self.input_layernorm is not None
            if self.norm_before_residual:
                hidden_states = self.hidden_norm(hidden_states)
                residual = hidden_states
            else:
                residual = hidden_states
                hidden_states = self.hidden_norm(hidden_states)
            x = torch.cat([self.input_layernorm(embeds), hidden_states], dim=-1)
        elif self.input_layernorm is None:
            x, residual = hidden_states, hidden_states
        elif residual is None:
            x, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            x, residual = self.input_layernorm(hidden_states, residual)
        x = self.self_attn(positions, x, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class EagleHead(nn.Module):
    """The head over the flattened tokens of one draft forward."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = (VocabEmbedding(config.vocab_size, h)
                             if config.has_embed_tokens else None)
        if config.eagle3:
            self.fc = (Linear(3 * config.target_hidden_size, h)
                       if config.use_aux_hidden_state else None)
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.lm_head = Linear(h, config.draft_vocab_size) if config.has_lm_head else None
            # draft id -> target id offset (zeros: the same ids)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size,
                                                    dtype=torch.int64), persistent=False)
        else:
            self.fc = Linear(h + config.target_hidden_size, h)
            self.lm_head = None
            if config.add_para_norm:
                self.embedding_layernorm = RMSNorm(h, config.rms_norm_eps)
                self.hidden_states_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            [EagleDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self._target: list[Any] = []  # the target model, for what the head shares

    def share(self, target: Any) -> None:
        """Use the target's embeddings and LM head where the checkpoint has none."""
        self._target = [target]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self._target[0].model.embed_tokens(input_ids)

    def combine(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the first forward reads them (EAGLE-3: three
        layers' states through ``fc``)."""
        if self.config.eagle3 and self.fc is not None:
            return self.fc(target_hidden)
        return target_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, attn_metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the states the LM head reads, the states the next draft reads)."""
        embeds = self._embed(input_ids)
        if not self.config.eagle3:
            if self.config.add_para_norm:
                embeds = self.embedding_layernorm(embeds)
                hidden_states = self.hidden_states_layernorm(hidden_states)
            hidden_states = self.fc(torch.cat([embeds, hidden_states], dim=-1))
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, embeds, hidden_states, residual,
                                            attn_metadata)
        out = hidden_states + residual
        if not self.config.eagle3:
            return out, out
        return self.norm(out), out

    def draft_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The greedy draft (a target token id) after each row."""
        if self.config.eagle3 and self.lm_head is not None:
            best = self.lm_head(hidden_states).float().argmax(dim=-1)
            return best + self.d2t[best]
        logits = self._target[0].compute_logits(hidden_states)
        return logits.float().argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names as EAGLE's and EAGLE-3's trainers write them (with or without
        a ``model.`` prefix; EAGLE-3's one layer as ``midlayer``)."""

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith("midlayer."):
                    name = "layers.0." + name[len("midlayer."):]
                if name == "d2t":
                    self.d2t.copy_(tensor.to(torch.int64))
                    continue
                if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                    continue  # (t2d: the inverse map, not needed for drafting)
                if name == "embed_tokens.weight" and self.embed_tokens is None:
                    continue
                if name == "lm_head.weight" and self.lm_head is None:
                    continue
                yield name, tensor

        return load_packed_weights(self, renamed(), PACKED_QKV_GATE_UP) | {"d2t"}
