"""Gemma 3 as a bidirectional encoder (``Gemma3TextModel`` with
``use_bidirectional_attention``: EmbeddingGemma): Gemma 3's layers (``gemma3``), with every
token attending to every token of its sequence instead of the ones before it.

The sliding layers keep a window, made symmetric as transformers makes it: a token sees
the tokens less than ``sliding_window // 2 + 1`` positions away on either side. There is
no KV cache (an encoder-only model: ``vllmpy.layers.encoder_attention``), no LM head, and
the checkpoint's names are the bare model's (``layers.N...``, ``embed_tokens``, ``norm``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError
from vllmpy.layers.attention import SelfAttention
from vllmpy.layers.encoder_attention import encoder_attention, padded_layout
from vllmpy.layers.norm import GemmaRMSNorm
from vllmpy.models.gemma3 import Gemma3Config, Gemma3Model
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights


@dataclass(frozen=True)
class Gemma3EncoderConfig(Gemma3Config):
    ENCODER_ONLY: ClassVar[bool] = True

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Gemma3EncoderConfig:
        if cfg.get("use_bidirectional_attention") is not True:
            raise ConfigError(f"{architecture} config: use_bidirectional_attention is not "
                              f"true; a causal Gemma 3 text model serves as "
                              f"Gemma3ForCausalLM (with --runner pooling to embed)")
        rest = {k: v for k, v in cfg.items() if k != "use_bidirectional_attention"}
        return Gemma3Config.from_hf.__func__(cls, rest, architecture)  # type: ignore[attr-defined]


def window_bias(meta: AttentionMetadata, reach: int, heads: int, device: torch.device
                ) -> torch.Tensor | None:
    """The additive bias of a symmetric window (0 within ``reach`` positions, -inf past
    it) in the step's padded layout; None when no sequence is long enough to need it."""
    layout = padded_layout(meta, device)
    if layout.longest <= reach:
        return None
    cache = getattr(meta, "_window_bias", {})
    if reach not in cache:
        pos = torch.arange(layout.longest, device=device)
        far = (pos[:, None] - pos[None, :]).abs() >= reach
        bias = torch.zeros(layout.longest, layout.longest, device=device)
        cache[reach] = bias.masked_fill(far, float("-inf"))[None, None].expand(
            layout.num_seqs, heads, -1, -1)
        meta._window_bias = cache  # type: ignore[attr-defined]
    return cache[reach]


class BidirectionalSelfAttention(SelfAttention):
    """Gemma 3's attention block (projections, q/k norms, rotary) over the step's whole
    sequences, without a KV cache."""

    def __init__(self, *args: Any, sliding_window: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale = self.attn.scale
        del self.attn  # no paged attention: nothing to cache
        # transformers: sliding_window // 2 + 1, exclusive, on either side
        self.reach = None if sliding_window is None else sliding_window // 2 + 1

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor,
                    attn_metadata: AttentionMetadata) -> torch.Tensor:
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        assert self.q_norm is not None and self.k_norm is not None
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).view(n, -1)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).view(n, -1)
        assert self.rotary_emb is not None
        q, k = self.rotary_emb(positions, q, k)
        bias = (None if self.reach is None else
                window_bias(attn_metadata, self.reach, self.num_heads, q.device))
        out = encoder_attention(q.reshape(n, self.num_heads, self.head_dim),
                                k.reshape(n, self.num_kv_heads, self.head_dim),
                                v.reshape(n, self.num_kv_heads, self.head_dim),
                                attn_metadata, scale=self.scale, bias=bias)
        return self.o_proj(out)


class Gemma3TextEncoder(nn.Module):
    """EmbeddingGemma's transformer; the sentence-transformers modules pool it."""

    default_pooling_type = "MEAN"  # what EmbeddingGemma's own 1_Pooling says

    def __init__(self, config: Gemma3EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        for i, layer in enumerate(self.model.layers):
            old = layer.self_attn
            layer.self_attn = BidirectionalSelfAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                config.head_dim, rotary=old.rotary_emb, scale=old.attn.scale,
                qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                qk_norm=partial(GemmaRMSNorm, eps=config.rms_norm_eps),
                sliding_window=config.layer_windows[i],
                logit_softcap=config.attn_logit_softcapping)
            if config.attn_logit_softcapping is not None:
                raise ConfigError("Gemma3TextModel: attn_logit_softcapping is not supported "
                                  "with bidirectional attention")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The bare model's tensors (``layers.N...``), or a wrapped checkpoint's
        (``model.layers.N...``)."""
        named = ((name if name.startswith("model.") else f"model.{name}", tensor)
                 for name, tensor in weights)
        return load_packed_weights(self, named, PACKED_QKV_GATE_UP, ("rotary_emb.inv_freq",))
