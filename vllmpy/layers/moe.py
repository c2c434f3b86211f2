"""Mixture-of-Experts blocks: the router's expert choice and the experts' stacked weights.

Routing (``select_experts``) follows the Hugging Face modeling files:
- softmax scoring (Qwen2/3-MoE, Mixtral, OLMoE): softmax over every expert in fp32, the
  top k, renormalised to sum to 1 when the config says ``norm_topk_prob``;
- sigmoid scoring (DeepSeek-V3): sigmoid scores, a per-expert correction bias added for
  the choice only, the experts split into ``n_group`` groups ranked by the sum of their two
  best biased scores, the top k chosen inside the best ``topk_group`` groups, their
  unbiased scores renormalised (when set) and multiplied by ``routed_scaling_factor``.
``torch.topk`` breaks ties as transformers does, since it is the call transformers makes.

``FusedMoE`` holds every expert's gate and up projections stacked as ``w13`` [E, 2I, H]
and the down projections as ``w2`` [E, H, I], loaded from a checkpoint's per-expert
tensors (``experts.N.gate_proj.weight`` ...). Its native forward sorts the (token, expert)
pairs by expert and runs one matmul pair per expert that has tokens, then adds each
product, times its routing weight, into its token's row: no Python loop over tokens. On
CUDA it runs ``vllmpy.ops.fused_moe``: two grouped GEMMs over the pairs sorted by expert,
with no host synchronisation, so decode steps are captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.config import ConfigError
from vllmpy.layers.custom_op import CustomOp
from vllmpy.layers.linear import Linear

# a checkpoint's names for each expert's gate, up and down projections
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool,
                   scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                   n_group: int | None = None, topk_group: int | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing weights (fp32) and expert ids (int64), both [T, top_k], of router logits
    [T, E]; see the module docstring for the two scorings."""
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must lie in 1..{num_experts}, got {top_k}")
    logits = logits.float()
    if scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * routed_scaling_factor if routed_scaling_factor != 1.0 else weights, ids
    if scoring != "sigmoid":
        raise ValueError(f"unknown router scoring {scoring!r} (softmax or sigmoid)")
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group is not None and n_group > 1:
        if num_experts % n_group or not topk_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group {n_group} must divide the {num_experts} experts and "
                             f"topk_group ({topk_group}) lie in 1..{n_group}")
        grouped = choice.view(-1, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j], for x
    [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]; in x's dtype, each
    expert's products accumulated as ``F.linear`` does and the weighted sum in fp32."""
    tokens, top_k = ids.shape
    num_experts = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = x[order // top_k]
    products = torch.empty((tokens * top_k, w2.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            seg = rows[start:start + count]
            gate, up = F.linear(seg, w13[expert]).chunk(2, dim=-1)
            products[start:start + count] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
    scaled = products.float() * weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros((tokens, w2.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, order // top_k, scaled)
    return out.to(x.dtype)


class FusedMoE(CustomOp):
    """Experts with SiLU-gated MLPs: ``w13`` [E, 2I, H] and ``w2`` [E, H, I], filled from
    per-expert checkpoint tensors through ``load_expert_tensor``; ``forward(x, weights,
    ids)`` takes the router's choice."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 names: tuple[str, str, str] = EXPERT_PROJECTIONS) -> None:
        super().__init__()
        self.names = names
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                               requires_grad=False)
        self._filled: set[tuple[int, int]] = set()  # (expert, projection) loaded

    def load_expert_tensor(self, rest: str, tensor: torch.Tensor, name: str) -> None:
        """Copy checkpoint tensor ``name``, whose part under this layer is ``rest``
        (``"3.gate_proj.weight"``), into its expert's slice."""
        parts = rest.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in self.names:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        if parts[2] != "weight" or tensor.dtype not in (torch.float32, torch.bfloat16,
                                                        torch.float16):
            raise ValueError(f"checkpoint tensor {name!r} ({tensor.dtype}): quantized MoE "
                             "experts are not supported yet, only float16 / bfloat16 / "
                             "float32 expert weights")
        expert, proj = int(parts[0]), self.names.index(parts[1])
        if expert >= self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r} names expert {expert}; the "
                             f"config has {self.num_experts}")
        i = self.intermediate_size
        dest = (self.w13.data[expert, :i], self.w13.data[expert, i:], self.w2.data[expert])[proj]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        self._filled.add((expert, proj))

    def missing(self) -> list[str]:
        """The per-expert tensors the checkpoint has not filled."""
        return [f"{e}.{self.names[p]}.weight" for e in range(self.num_experts)
                for p in range(3) if (e, p) not in self._filled]

    def forward_cuda(self, x: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
        from vllmpy.ops.fused_moe import fused_moe

        return fused_moe(x, self.w13, self.w2, weights, ids)

    def forward_native(self, x: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        return moe_reference(x, self.w13, self.w2, weights, ids)


class SparseMoeBlock(nn.Module):
    """A softmax-routed MoE MLP: ``gate`` (the router, [E, H], no bias) and ``experts``
    (``FusedMoE``), the layout of Qwen2/3-MoE, Mixtral and OLMoE checkpoints."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int,
                 top_k: int, renormalize: bool,
                 names: tuple[str, str, str] = EXPERT_PROJECTIONS) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"num_experts_per_tok={top_k} must lie in 1..{num_experts}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids)
