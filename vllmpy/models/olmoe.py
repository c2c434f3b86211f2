"""OLMoE: Llama's pre-norm decoder with a sparse MoE MLP in every layer, read top to bottom
like the Hugging Face modeling file, over the flattened tokens of one engine step.

Against Llama: q and k are each RMS-normalised over the whole projection (all heads
together, as in OLMo-2) before rotary; with ``clip_qkv`` the normalised q and k and the
raw v are clamped to [-clip_qkv, clip_qkv]; the MLP is a softmax top-k router ``mlp.gate``
over experts ``mlp.experts.N.{gate,up,down}_proj`` (each of ``intermediate_size``), the
top-k probabilities renormalised only with ``norm_topk_prob``.

From GGUF (llama.cpp's ``olmoe``): ``attn_q_norm`` / ``attn_k_norm`` beside the common
names, the experts stacked as ``ffn_{gate,up,down}_exps``, q/k rows as in Hugging Face.
llama.cpp runs this architecture without renormalising the top-k weights and sizes the
experts by ``feed_forward_length`` (see ``_gguf_config``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, rms_norm_linear, tie_quantized_lm_head
from vllmpy.layers.moe import SparseMoeBlock
from vllmpy.layers.norm import Normed, RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata, moe_config
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights


@dataclass(frozen=True)
class OlmoeConfig(TextModelConfig):
    intermediate_size: int  # each expert's
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    clip_qkv: float | None  # clamp q, k (after their norms) and v to +-clip_qkv
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool  # q, k, v and o carry biases

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> OlmoeConfig:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")
        r.refuse("sliding_window", why="OLMoE attends to every token")
        fields = decoder_fields(r, architecture)
        fields["max_position_embeddings"] = r.get("max_position_embeddings", 4096, int)
        hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
        if fields["head_dim"] * heads != hidden:  # the q norm spans hidden_size
            raise ConfigError(f"{architecture} config 'head_dim'={fields['head_dim']} is not "
                              f"supported: OLMoE's q/k norms need head_dim = hidden_size / "
                              f"num_attention_heads = {hidden // heads}")
        clip = r.get("clip_qkv", None, float)
        if clip is not None and clip <= 0:
            raise ConfigError(f"{architecture} config 'clip_qkv'={clip} must be positive")
        theta, scaling = rope_settings(r)
        return cls(**fields,
                   intermediate_size=r.get("intermediate_size", 2048, int),
                   num_experts=r.first(("num_experts", "num_local_experts"), 64),
                   num_experts_per_tok=r.get("num_experts_per_tok", 8, int),
                   norm_topk_prob=r.get("norm_topk_prob", False, bool),
                   clip_qkv=clip,
                   rms_norm_eps=r.get("rms_norm_eps", 1e-5, float),
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", False, bool))


class ClippedRMSNorm(RMSNorm):
    """An RMSNorm whose output is clamped to [-clip, clip] (OLMoE's q/k under clip_qkv);
    its one parameter is still ``weight``."""

    def __init__(self, hidden_size: int, eps: float, clip: float) -> None:
        super().__init__(hidden_size, eps)
        self.clip = clip

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Normed:
        if residual is not None:
            raise ValueError("ClippedRMSNorm takes no residual")
        return super().forward(x).clamp(-self.clip, self.clip)


class OlmoeDecoderLayer(nn.Module):
    def __init__(self, config: OlmoeConfig, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        eps, clip = config.rms_norm_eps, config.clip_qkv
        norm = (partial(RMSNorm, eps=eps) if clip is None
                else partial(ClippedRMSNorm, eps=eps, clip=clip))
        # q_norm / k_norm span all heads of the projection: [num_heads * head_dim]
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, qkv_bias=config.attention_bias,
            o_bias=config.attention_bias, qk_norm=norm, qk_norm_per_head=False)
        self.clip_qkv = clip
        self.v_start = self.self_attn.q_size + self.self_attn.kv_size  # v's columns of qkv
        self.mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                                  config.intermediate_size, config.num_experts_per_tok,
                                  config.norm_topk_prob)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        if self.clip_qkv is not None:  # v here; q and k after their norms (ClippedRMSNorm)
            qkv[:, self.v_start:].clamp_(-self.clip_qkv, self.clip_qkv)
        hidden_states = self.self_attn.forward_qkv(positions, qkv, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class OlmoeModel(nn.Module):
    def __init__(self, config: OlmoeConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [OlmoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class OlmoeForCausalLM(nn.Module):
    def __init__(self, config: OlmoeConfig) -> None:
        super().__init__()
        self.config = config
        self.model = OlmoeModel(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names, one tensor per expert projection, or
        one stacked tensor per projection from GGUF); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


# ---- GGUF: llama.cpp's "olmoe" ---------------------------------------------------------

def _gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """The expert count and top-k from the file; the top-k weights as llama.cpp runs this
    architecture (never renormalised); each expert ``feed_forward_length`` wide (the
    converter writes no expert width, and llama.cpp reads none); q, k, v and o biases if
    the tensors carry them; and ``attention.clamp_kqv``, which the converter does not
    write, as ``clip_qkv`` where a file sets it."""
    arch = meta.architecture
    moe = moe_config(meta, "num_experts")
    extra: dict[str, Any] = {
        "num_experts": moe.get("num_experts"),
        "num_experts_per_tok": moe.get("num_experts_per_tok"),
        "norm_topk_prob": False,
        "attention_bias": "blk.0.attn_q.bias" in meta.tensor_names,
    }
    if (clip := meta.metadata(f"{arch}.attention.clamp_kqv")) is not None and clip > 0:
        extra["clip_qkv"] = float(clip)
    if extra["num_experts"] is None or extra["num_experts_per_tok"] is None:
        raise ConfigError(f"{meta.path}: {arch}.expert_count and {arch}.expert_used_count "
                          "are both needed for an OLMoE file")
    return extra


GGUF_ARCH = GGUFArch(config=_gguf_config,
                     block_parts={"attn_q_norm": "self_attn.q_norm",
                                  "attn_k_norm": "self_attn.k_norm"})
