"""NVIDIA Nemotron-H (Nemotron-H, Nemotron Nano 2 and 3): a stack of single-mixer blocks,
each an RMSNorm, one mixer and a residual add, the mixer chosen per layer by
``layers_block_type`` (or the older ``hybrid_override_pattern``): ``M`` a Mamba2 mixer,
``*`` attention, ``-`` an MLP (ReLU squared, no gate), ``E`` a MoE (sigmoid routing with a
score correction bias and groups, ungated ReLU-squared experts, a shared MLP, optionally
in a latent space). Read top to bottom like the Hugging Face modeling file.

The attention has no positional encoding (transformers' NemotronH applies none) and no
biases. The Mamba2 mixers clamp dt from below at ``time_step_min`` (transformers'
``time_step_limit`` of the mixer), not at the config's ``time_step_limit``.

Checkpoints name the modules under ``backbone`` (``backbone.layers.N.mixer...``), as
transformers writes them and NVIDIA's checkpoints do; ``model.`` names are read as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.core.cache_spec import CacheSpec, PagedKVSpec
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear
from vllmpy.layers.mamba2 import Mamba2Mixer, mamba2_state_spec
from vllmpy.layers.moe import UngatedMoE, select_experts
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.config_reader import ConfigReader, decoder_fields
from vllmpy.models.weights import load_packed_weights

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
# hybrid_override_pattern characters, and the older layer names, as transformers reads them
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LEGACY_NAMES = {"mamba": MAMBA, "attention": ATTENTION}
PACKED_QKV: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


def _block_types(r: ConfigReader) -> list[str]:
    arch = r.architecture
    types = r.cfg.get("layers_block_type", r.cfg.get("layer_types"))
    if types is None:
        pattern = r.need("hybrid_override_pattern", str)
        if set(pattern) - set(PATTERN):
            raise ConfigError(f"{arch} config 'hybrid_override_pattern'={pattern!r}: "
                              f"characters {sorted(set(pattern) - set(PATTERN))} are not "
                              f"supported; supported: {''.join(PATTERN)}")
        return [PATTERN[c] for c in pattern]
    if not isinstance(types, list) or not types:
        raise ConfigError(f"{arch} config 'layers_block_type' must be a list, got {types!r}")
    types = [LEGACY_NAMES.get(t, t) for t in types]
    for t in types:
        if t not in (MAMBA, ATTENTION, MLP, MOE):
            raise ConfigError(f"{arch} config 'layers_block_type' entry {t!r} is not "
                              f"supported; supported: {[MAMBA, ATTENTION, MLP, MOE]}")
    return types


@dataclass(frozen=True)
class NemotronHConfig(TextModelConfig):
    block_types: tuple[str, ...]  # per layer: linear_attention, full_attention, mlp or moe
    layer_norm_epsilon: float
    intermediate_size: int  # the MLP layers'
    mlp_bias: bool
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_bias: bool  # the Mamba in_proj and out_proj biases
    use_conv_bias: bool
    time_step_min: float  # dt's lower clamp
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None  # the experts' width when they run in a latent space
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> NemotronHConfig:
        r = ConfigReader(cfg, architecture)
        types = _block_types(r)
        r.expect("mlp_hidden_act", ("relu2",), "relu2")
        r.expect("mamba_hidden_act", ("silu", "swish"), "silu")
        r.refuse("attention_bias", unless=False, why="NemotronH attention has no biases")
        r.refuse("sliding_window", why="NemotronH attention sees every token")
        # the block list decides the depth (transformers ignores num_hidden_layers)
        fields = decoder_fields(ConfigReader({**cfg, "num_hidden_layers": len(types)},
                                             architecture),
                                architecture, (None,) * len(types))
        fields.update(num_key_value_heads=r.get("num_key_value_heads",
                                                fields["num_attention_heads"], int),
                      head_dim=r.get("head_dim", 128, int),
                      max_position_embeddings=r.get("max_position_embeddings", 4096, int),
                      tie_word_embeddings=False)  # transformers never ties this head
        heads = r.get("mamba_num_heads", 128, int)
        groups = r.first(("n_groups", "mamba_n_groups"), 8)
        if groups < 1 or heads % groups:
            raise ConfigError(f"{architecture} config 'n_groups'={groups} must divide "
                              f"mamba_num_heads ({heads})")
        kernel = r.first(("conv_kernel", "mamba_d_conv"), 4)
        if kernel < 2:
            raise ConfigError(f"{architecture} config 'conv_kernel'={kernel} is not "
                              "supported (at least 2)")
        experts = r.get("n_routed_experts", 8, int)
        top_k = r.get("num_experts_per_tok", 2, int)
        if MOE in types and not 1 <= top_k <= experts:
            raise ConfigError(f"{architecture} config 'num_experts_per_tok'={top_k} must lie "
                              f"in 1..'n_routed_experts' ({experts})")
        return cls(**fields, block_types=tuple(types),
                   layer_norm_epsilon=r.get("layer_norm_epsilon", 1e-5, float),
                   intermediate_size=r.get("intermediate_size", 21504, int),
                   mlp_bias=r.get("mlp_bias", False, bool),
                   mamba_num_heads=heads, mamba_head_dim=r.get("mamba_head_dim", 64, int),
                   ssm_state_size=r.get("ssm_state_size", 128, int), n_groups=groups,
                   conv_kernel=kernel, use_bias=r.get("use_bias", False, bool),
                   use_conv_bias=r.first(("use_conv_bias", "mamba_conv_bias"), True, bool),
                   time_step_min=r.first(("time_step_min", "mamba_dt_min"), 0.001, float),
                   n_routed_experts=experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=r.get("moe_intermediate_size", 7688, int),
                   moe_shared_expert_intermediate_size=r.get(
                       "moe_shared_expert_intermediate_size", 7688, int),
                   moe_latent_size=r.get("moe_latent_size", None, int),
                   routed_scaling_factor=r.get("routed_scaling_factor", 1.0, float),
                   n_group=r.get("n_group", 1, int), topk_group=r.get("topk_group", 1, int),
                   norm_topk_prob=r.get("norm_topk_prob", True, bool))

    def layer_cache_specs(self) -> tuple[CacheSpec, ...]:
        """Per Mamba layer its state, per attention layer its paged K/V, in layer order."""
        mamba = mamba2_state_spec(self.mamba_num_heads, self.mamba_head_dim,
                                  self.ssm_state_size, self.n_groups, self.conv_kernel)
        attention = PagedKVSpec(self.num_key_value_heads, self.head_dim, None)
        return tuple(mamba if t == MAMBA else attention
                     for t in self.block_types if t in (MAMBA, ATTENTION))


class NemotronHMLP(nn.Module):
    """down_proj(relu(up_proj(x)) ** 2), no gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


class NemotronHTopkRouter(nn.Module):
    """float32 router ``weight`` [E, H] and ``e_score_correction_bias`` [E] (kept in
    float32 whatever the model's dtype, as transformers keeps them): sigmoid scores,
    the bias added for the choice only (``select_experts``' sigmoid scoring)."""

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(experts, dtype=torch.float32), requires_grad=False)
        for p in (self.weight, self.e_score_correction_bias):
            p.keep_dtype = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = F.linear(x.float(), self.weight)  # [T, E]
        return select_experts(logits, c.num_experts_per_tok, c.norm_topk_prob, "sigmoid",
                              self.e_score_correction_bias, c.n_group, c.topk_group,
                              c.routed_scaling_factor)


class NemotronHMoE(nn.Module):
    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        width = config.moe_latent_size or config.hidden_size
        self.gate = NemotronHTopkRouter(config)
        self.experts = UngatedMoE(config.n_routed_experts, width,
                                  config.moe_intermediate_size, "relu2")
        self.shared_experts = NemotronHMLP(config.hidden_size,
                                           config.moe_shared_expert_intermediate_size,
                                           config.mlp_bias)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if config.moe_latent_size is not None:
            self.fc1_latent_proj = Linear(config.hidden_size, width, bias=config.mlp_bias)
            self.fc2_latent_proj = Linear(width, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(hidden_states)
        x = hidden_states
        if self.fc1_latent_proj is not None:
            x = self.fc1_latent_proj(x)
        x = self.experts(x, weights, ids)
        if self.fc2_latent_proj is not None:
            x = self.fc2_latent_proj(x)
        return x + self.shared_experts(hidden_states)


class NemotronHBlock(nn.Module):
    def __init__(self, config: NemotronHConfig, layer_idx: int) -> None:
        super().__init__()
        self.block_type = config.block_types[layer_idx]
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer: nn.Module
        if self.block_type == MAMBA:
            self.mixer = Mamba2Mixer(
                config.hidden_size, config.mamba_num_heads, config.mamba_head_dim,
                config.ssm_state_size, config.n_groups, config.conv_kernel,
                eps=config.layer_norm_epsilon, proj_bias=config.use_bias,
                conv_bias=config.use_conv_bias,
                time_step_limit=(config.time_step_min, float("inf")))
        elif self.block_type == ATTENTION:
            self.mixer = SelfAttention(config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, config.head_dim,
                                       rotary=None)
        elif self.block_type == MLP:
            self.mixer = NemotronHMLP(config.hidden_size, config.intermediate_size,
                                      config.mlp_bias)
        else:
            self.mixer = NemotronHMoE(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.norm(hidden_states)
        else:
            hidden_states, residual = self.norm(hidden_states, residual)
        if self.block_type == MAMBA:
            return self.mixer(hidden_states, attn_metadata), residual
        if self.block_type == ATTENTION:
            return self.mixer(positions, hidden_states, attn_metadata), residual
        return self.mixer(hidden_states), residual


class NemotronHModel(nn.Module):
    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([NemotronHBlock(config, i)
                                     for i in range(config.num_hidden_layers)])
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm_f(hidden_states, residual)
        return hidden_states


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' in-memory names (``model.``) read as the checkpoints' (``backbone.``)."""
    for name, tensor in weights:
        if name.startswith("model."):
            name = "backbone." + name[len("model."):]
        if name.startswith("backbone.embedding."):
            name = "backbone.embeddings." + name[len("backbone.embedding."):]
        yield name, tensor


class NemotronHForCausalLM(nn.Module):
    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = NemotronHModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.backbone(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.backbone.embeddings, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names; the multi-token-prediction layers,
        ``mtp.*``, are not used); returns the parameter names loaded."""
        weights = ((n, t) for n, t in _renamed(weights) if not n.startswith("mtp."))
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV) | scales.loaded
