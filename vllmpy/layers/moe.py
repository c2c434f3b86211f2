"""Mixture-of-Experts blocks: the router's expert choice and the experts' stacked weights.

Routing (``select_experts``) follows the Hugging Face modeling files:
- softmax scoring (Qwen2/3-MoE, Mixtral, OLMoE): softmax over every expert in fp32, the
  top k, renormalised to sum to 1 when the config says ``norm_topk_prob``; with
  ``n_group`` > 1 (DeepSeek-V2's ``group_limited_greedy``) the experts are split into
  ``n_group`` groups ranked by their best score, and the top k are chosen inside the best
  ``topk_group`` groups (the others' scores count as 0, as transformers masks them);
- top-k-then-softmax scoring (GPT-OSS, GraniteMoE): the top k of the logits, softmaxed
  among themselves: the renormalised weights of softmax scoring, but chosen on the logits
  (two logits that differ can round to one probability, and the experts must be the ones
  transformers picks);
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

A quantized checkpoint's experts go through the experts' method that its quantization
config gives the layer (``QuantizationConfig.moe_method``, applied by ``quantize_model``
through ``set_method``): it owns ``w13`` / ``w2`` (in its storage dtype) and their
scales, takes the checkpoint's tensors and runs the forward. Without one the experts are
float and a quantized expert tensor is refused by name. A block's router is marked
(``mark_router``) so that the config gives it its router method (FP8 keeps routers in
the model's dtype).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy import envs
from vllmpy.config import ConfigError
from vllmpy.layers.custom_op import CustomOp
from vllmpy.layers.linear import Linear
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.quantization.base import MoEMethod, mark_router

__all__ = ["EXPERT_PROJECTIONS", "ExpertLayout", "FusedMoE", "SparseMoeBlock",
           "UngatedMoE", "expert_activation", "mark_router", "moe_reference",
           "moe_stats_summary", "reset_moe_stats", "select_experts",
           "ungated_moe_dense", "ungated_moe_reference"]

# a checkpoint's names for each expert's gate, up and down projections
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool,
                   scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                   n_group: int | None = None, topk_group: int | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing weights (fp32) and expert ids (int64), both [T, top_k], of router logits
    [T, E]; see the module docstring for the three scorings. On CUDA the softmax scoring
    without groups runs in one launch (``vllmpy.ops.moe_router``)."""
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must lie in 1..{num_experts}, got {top_k}")
    if (scoring == "softmax" and logits.is_cuda and (n_group is None or n_group <= 1)
            and logits.dim() == 2 and logits.stride(-1) == 1):
        from vllmpy.ops import moe_router

        if num_experts <= moe_router.MAX_EXPERTS:
            return moe_router.softmax_topk(logits, top_k, renormalize, routed_scaling_factor)
    logits = logits.float()
    if scoring == "softmax":
        probs = torch.softmax(logits, dim=-1)
        if n_group is not None and n_group > 1:
            probs = _group_limited(probs, n_group, topk_group, rank_by_top=1, hidden=0.0)
            weights, ids = torch.topk(probs, top_k, dim=-1, sorted=False)
        else:
            weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * routed_scaling_factor if routed_scaling_factor != 1.0 else weights, ids
    if scoring == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    if scoring != "sigmoid":
        raise ValueError(f"unknown router scoring {scoring!r} (softmax, topk_softmax or "
                         "sigmoid)")
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group is not None and n_group > 1:
        choice = _group_limited(choice, n_group, topk_group, rank_by_top=2,
                                hidden=float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def _group_limited(scores: torch.Tensor, n_group: int, topk_group: int | None,
                   rank_by_top: int, hidden: float) -> torch.Tensor:
    """``scores`` [T, E] with the experts outside each token's best ``topk_group`` of
    ``n_group`` groups set to ``hidden``; a group ranks by the sum of its
    ``rank_by_top`` best scores."""
    num_experts = scores.shape[-1]
    if num_experts % n_group or not topk_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group {n_group} must divide the {num_experts} experts and "
                         f"topk_group ({topk_group}) lie in 1..{n_group}")
    grouped = scores.view(-1, n_group, num_experts // n_group)
    group_scores = grouped.topk(min(rank_by_top, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, num_experts)
    return scores.masked_fill(~keep, hidden)


def expert_activation(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu",
                      alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The gated activation of an expert's gate and up products: ``silu`` (silu(gate) * up)
    or ``swigluoai`` (GPT-OSS: gate clamped above at ``limit``, up to +-``limit``, then
    (up + 1) * gate * sigmoid(alpha * gate))."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swigluoai":
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"unknown expert activation {activation!r} (silu or swigluoai)")


EXPERT_ACTIVATIONS = ("silu", "swigluoai")


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: str = "silu", alpha: float = 1.702,
                  limit: float = 7.0) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t))) with e = ids[t, j], for x
    [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I] and optional biases
    [E, 2I] / [E, H]; in x's dtype, each expert's products accumulated as ``F.linear``
    does and the weighted sum in fp32."""
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
            b13 = None if w13_bias is None else w13_bias[expert]
            b2 = None if w2_bias is None else w2_bias[expert]
            gate, up = F.linear(seg, w13[expert], b13).chunk(2, dim=-1)
            act = expert_activation(gate, up, activation, alpha, limit)
            products[start:start + count] = F.linear(act, w2[expert], b2)
            start += count
    scaled = products.float() * weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros((tokens, w2.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, order // top_k, scaled)
    return out.to(x.dtype)


@dataclass(frozen=True)
class ExpertLayout:
    """How a checkpoint spells one layer's experts (the names under the experts module).
    Every layout lands in ``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I].

    - one tensor per expert and projection: ``N.<names[i]>.weight`` (Qwen-MoE, Mixtral);
    - one stacked [E, out, in] tensor per projection: ``<names[i]>.weight`` (GGUF's
      ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``);
    - gate and up fused: ``<gate_up>`` [E, 2I, H] and ``<down>`` [E, H, I] (with or
      without ``.weight``); ``transposed`` ones are [E, H, 2I] / [E, I, H] and
      ``interleaved`` ones alternate gate and up along 2I (GPT-OSS), with their biases
      ``<gate_up>_bias`` [E, 2I] and ``<down>_bias`` [E, H].
    """

    names: tuple[str, str, str] = EXPERT_PROJECTIONS
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    transposed: bool = False
    interleaved: bool = False


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# MoE layers that count the tokens routed to each expert (VT_MOE_STATS=1), in build order
_COUNTING: list[weakref.ref[FusedMoE]] = []


def moe_stats_summary() -> list[str]:
    """Lines of the tokens routed to each expert so far, per counting layer and overall."""
    layers = [(i, m) for i, ref in enumerate(_COUNTING) if (m := ref()) is not None]
    if not layers:
        return []
    lines = ["MoE expert load (token rows routed per expert; CUDA-graph padding rows count):"]
    total = None
    for i, moe in layers:
        counts = moe.expert_tokens.cpu()
        total = counts.clone() if total is None else total + counts
        lines.append(f"  layer {i}: " + _load_line(counts))
    if total is not None and len(layers) > 1:
        lines.append("  all layers: " + _load_line(total))
    return lines


def reset_moe_stats(model: nn.Module) -> None:
    """Zero the expert-load counts of ``model``'s MoE layers (VT_MOE_STATS=1): once the
    engine is up, so that the summary counts requests, not start-up's warm-up passes."""
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.expert_tokens is not None:
            module.expert_tokens.zero_()


def _load_line(counts: torch.Tensor) -> str:
    n = counts.numel()
    mean = counts.float().mean().item()
    top = torch.argsort(counts, descending=True, stable=True)[:3].tolist()
    idle = int((counts == 0).sum())
    ratio = counts.max().item() / mean if mean > 0 else 0.0
    return (f"{int(counts.sum())} routed over {n} experts, min {int(counts.min())} "
            f"mean {mean:.1f} max {int(counts.max())} (max/mean {ratio:.2f}), "
            f"{idle} idle, busiest {top}")


def _print_moe_stats() -> None:
    lines = moe_stats_summary()
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)


class FusedMoE(CustomOp):
    """Experts with gated MLPs: ``w13`` [E, 2I, H] and ``w2`` [E, H, I] (and, with
    ``bias``, ``w13_bias`` [E, 2I] / ``w2_bias`` [E, H]), filled from a checkpoint's
    tensors in ``layout`` through ``load_expert_tensor``; ``forward(x, weights, ids)``
    takes the router's choice. ``activation`` is ``silu`` or GPT-OSS's ``swigluoai``."""

    # an fp8 experts' method's scale grids (``vllmpy.layers.quantization.fp8``)
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 names: tuple[str, str, str] = EXPERT_PROJECTIONS, *,
                 layout: ExpertLayout | None = None, bias: bool = False,
                 activation: str = "silu", swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0) -> None:
        super().__init__()
        if activation not in EXPERT_ACTIVATIONS:
            raise ConfigError(f"unknown expert activation {activation!r}; supported: "
                              f"{list(EXPERT_ACTIVATIONS)}")
        self.layout = layout if layout is not None else ExpertLayout(names=names)
        self.names = self.layout.names
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.swiglu_alpha = swiglu_alpha
        self.swiglu_limit = swiglu_limit
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                               requires_grad=False)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size),
                                        requires_grad=False)
        self._filled: set[tuple[int, int]] = set()  # (expert, projection) loaded
        self._filled_bias: set[str] = set()
        # the experts' quantization method (``set_method``), its parameters, and the
        # (expert, projection, suffix) triples the checkpoint has filled through it
        self.method: MoEMethod | None = None
        self.method_params: list[str] = []
        self._filled_method: set[tuple[int, int, str]] = set()
        self.expert_tokens: torch.Tensor | None
        if not envs.VT_MOE_STATS:
            self.expert_tokens = None
        else:
            self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64),
                                 persistent=False)
            if not _COUNTING:
                atexit.register(_print_moe_stats)
            _COUNTING.append(weakref.ref(self))

    # ---- loading ----

    def load_expert_tensor(self, rest: str, tensor: torch.Tensor, name: str) -> None:
        """Copy checkpoint tensor ``name``, whose part under this layer is ``rest``
        (``"3.gate_proj.weight"``, ``"gate_proj.weight"``, ``"gate_up_proj"``, ...), into
        its place; see ``ExpertLayout``. With an experts' method the weight and its
        scales go to the method (``experts.N.gate_proj.weight_scale_inv`` ...)."""
        if self.method is not None:
            self._load_through_method(rest, tensor, name)
            return
        parts = rest.split(".")
        if parts[0].isdigit():
            if len(parts) != 3 or parts[1] not in self.names:
                raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
            self._check_float(parts[2] == "weight", tensor, name)
            expert = int(parts[0])
            if expert >= self.num_experts:
                raise ValueError(f"checkpoint tensor {name!r} names expert {expert}; the "
                                 f"config has {self.num_experts}")
            proj = self.names.index(parts[1])
            self._copy(self._dest(proj)[expert], tensor, name)
            self._filled.add((expert, proj))
            return
        key = rest[:-len(".weight")] if rest.endswith(".weight") else rest
        lay = self.layout
        if key in (f"{lay.gate_up}_bias", f"{lay.down}_bias") or rest.endswith(".bias"):
            self._load_bias(key.removesuffix("_bias"), tensor, name)
            return
        stacked = {lay.gate_up: "w13", lay.down: "w2", self.names[2]: "w2",
                   self.names[0]: 0, self.names[1]: 1}
        if key not in stacked or (rest != key and rest != f"{key}.weight"):
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        self._check_float(True, tensor, name)
        target = stacked[key]
        if target == "w13" and key == lay.gate_up:
            self._copy(self.w13.data, self._oriented(key, tensor), name)
            projs: tuple[int, ...] = (0, 1)
        elif target == "w2":
            self._copy(self.w2.data, self._oriented(key, tensor), name)
            projs = (2,)
        else:
            assert isinstance(target, int)
            self._copy(self._dest(target), tensor, name)
            projs = (target,)
        self._filled.update((e, p) for e in range(self.num_experts) for p in projs)

    def _oriented(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A fused checkpoint tensor in the [E, out, in], gate-rows-then-up-rows order."""
        lay = self.layout
        if lay.transposed and key in (lay.gate_up, lay.down):
            tensor = tensor.transpose(1, 2)
        if lay.interleaved and key == lay.gate_up:
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        return tensor

    def _dest(self, proj: int) -> torch.Tensor:
        i = self.intermediate_size
        return (self.w13.data[:, :i], self.w13.data[:, i:], self.w2.data)[proj]

    def _load_bias(self, key: str, tensor: torch.Tensor, name: str) -> None:
        if self.w13_bias is None or self.w2_bias is None or key not in (self.layout.gate_up,
                                                                        self.layout.down):
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        self._check_float(True, tensor, name)
        if key == self.layout.gate_up:
            if self.layout.interleaved:
                tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
            self._copy(self.w13_bias.data, tensor, name)
        else:
            self._copy(self.w2_bias.data, tensor, name)
        self._filled_bias.add(key)

    @staticmethod
    def _check_float(is_weight: bool, tensor: torch.Tensor, name: str) -> None:
        if not is_weight or tensor.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"checkpoint tensor {name!r} ({tensor.dtype}): quantized MoE "
                             "experts are not supported yet, only float16 / bfloat16 / "
                             "float32 expert weights")

    @staticmethod
    def _copy(dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        dest.copy_(tensor)

    # ---- the experts' method ----

    def set_method(self, method: MoEMethod) -> None:
        """Give the experts a quantization method (before materialization): its
        parameters replace the float ``w13`` / ``w2``; biases stay as they are."""
        for name in self.method_params or ["w13", "w2"]:
            delattr(self, name)
        self.method_params = []
        self.method = method
        self._filled_method = set()
        method.create_weights(self)

    def _spelling(self, rest: str) -> tuple[int | None, tuple[int, ...], str, bool] | None:
        """(expert or None for all, projections, suffix, fused) of a tensor name under the
        layer, for the experts' method: ``N.<proj>.<suffix>`` (one expert),
        ``<proj>.<suffix>`` (stacked [E, ...]), ``<gate_up>`` / ``<down>`` with
        ``.weight``, ``.<suffix>`` or ``_<x>`` for suffix ``weight_<x>`` (fused:
        ``gate_up_proj_scale_inv``); None for anything else."""
        parts = rest.split(".")
        if parts[0].isdigit():
            if len(parts) != 3 or parts[1] not in self.names:
                return None
            return int(parts[0]), (self.names.index(parts[1]),), parts[2], False
        lay = self.layout
        fused = {lay.gate_up: (0, 1), lay.down: (2,)}
        head, _, suffix = rest.partition(".")
        if head in fused:
            return None, fused[head], suffix or "weight", True
        if head in self.names and suffix and "." not in suffix:
            return None, (self.names.index(head),), suffix, False
        for key, projs in fused.items():
            if rest.startswith(key + "_") and "." not in rest:
                return None, projs, "weight" + rest[len(key):], True
        return None

    def _load_through_method(self, rest: str, tensor: torch.Tensor, name: str) -> None:
        assert self.method is not None
        lay = self.layout
        key = rest.removesuffix(".weight")
        if key in (f"{lay.gate_up}_bias", f"{lay.down}_bias") or rest.endswith(".bias"):
            self._load_bias(key.removesuffix("_bias"), tensor, name)
            return
        spelled = self._spelling(rest)
        if spelled is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        expert, projs, suffix, fused = spelled
        if expert is not None and expert >= self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r} names expert {expert}; the "
                             f"config has {self.num_experts}")
        suffixes = self.method.checkpoint_suffixes(self)
        if suffix not in suffixes:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter "
                             f"({self.method.name} experts take {list(suffixes)})")
        if fused and (lay.transposed or (lay.interleaved and projs == (0, 1))):
            if suffix != "weight" or tensor.dtype not in _FLOAT_DTYPES:
                raise ValueError(f"checkpoint tensor {name!r}: {self.method.name} experts "
                                 "in a transposed or interleaved fused layout are not "
                                 "supported")
            tensor = self._oriented(rest.partition(".")[0], tensor)
        self.method.load(self, expert, projs, suffix, tensor, name)
        experts = range(self.num_experts) if expert is None else (expert,)
        self._filled_method.update((e, p, suffix) for e in experts for p in projs)
        if len(self._filled_method) == self.num_experts * 3 * len(suffixes):
            self.method.finish(self)  # the last of the layer's tensors

    def load_dense(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Fill the experts from dense [E, 2I, H] / [E, H, I] weights (random weights):
        copied, or quantized by the experts' method."""
        if self.method is None:
            self._copy(self.w13.data, w13, "w13")
            self._copy(self.w2.data, w2, "w2")
            self._filled.update((e, p) for e in range(self.num_experts) for p in range(3))
            return
        self.method.load_dense(self, w13, w2)
        suffixes = self.method.checkpoint_suffixes(self)
        self._filled_method.update((e, p, s) for e in range(self.num_experts)
                                   for p in range(3) for s in suffixes)
        self.method.finish(self)

    def describe_experts(self) -> str | None:
        """How quantized experts run, for the start-up line; None for float experts."""
        return None if self.method is None else self.method.describe(self)

    def missing(self) -> list[str]:
        """The expert tensors the checkpoint has not filled."""
        if self.method is not None:
            suffixes = self.method.checkpoint_suffixes(self)
            gone = [f"{e}.{self.names[p]}.{s}" for e in range(self.num_experts)
                    for p in range(3) for s in suffixes
                    if (e, p, s) not in self._filled_method]
        else:
            gone = [f"{e}.{self.names[p]}.weight" for e in range(self.num_experts)
                    for p in range(3) if (e, p) not in self._filled]
        if self.w13_bias is not None:
            gone += [f"{k}_bias" for k in (self.layout.gate_up, self.layout.down)
                     if k not in self._filled_bias]
        return gone

    # ---- running ----

    def _count(self, ids: torch.Tensor) -> None:
        if self.expert_tokens is not None:  # graph-safe: no host read
            flat = ids.reshape(-1)
            self.expert_tokens.scatter_add_(0, flat, torch.ones_like(flat))

    def bind_device(self, device: torch.device) -> None:
        super().bind_device(device)
        if self.method is not None:
            self.method.bind(self, device)

    def forward_cuda(self, x: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
        from vllmpy.ops.fused_moe import fused_moe

        self._count(ids)
        if self.method is not None:
            return self.method.apply(self, x, weights, ids)
        return fused_moe(x, self.w13, self.w2, weights, ids, self.w13_bias, self.w2_bias,
                         self.activation, self.swiglu_alpha, self.swiglu_limit)

    def forward_native(self, x: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        self._count(ids)
        if self.method is not None:
            return self.method.apply(self, x, weights, ids)
        return moe_reference(x, self.w13, self.w2, weights, ids, self.w13_bias,
                             self.w2_bias, self.activation, self.swiglu_alpha,
                             self.swiglu_limit)


class SparseMoeBlock(nn.Module):
    """A softmax-routed MoE MLP: ``gate`` (the router, [E, H]) and ``experts``
    (``FusedMoE``), the layout of Qwen2/3-MoE, Mixtral and OLMoE checkpoints; with
    ``shared_intermediate_size``, a dense gated MLP every token also takes
    (``shared_expert``), scaled by sigmoid(``shared_expert_gate``(x)) when
    ``shared_gate`` (Qwen2-MoE)."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int,
                 top_k: int, renormalize: bool,
                 names: tuple[str, str, str] = EXPERT_PROJECTIONS, *,
                 shared_intermediate_size: int = 0, shared_gate: bool = False,
                 router_bias: bool = False) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"num_experts_per_tok={top_k} must lie in 1..{num_experts}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = mark_router(Linear(hidden_size, num_experts, bias=router_bias))
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, names)
        self.shared_expert = (GatedMLP(hidden_size, shared_intermediate_size)
                              if shared_intermediate_size > 0 else None)
        self.shared_expert_gate = (Linear(hidden_size, 1)
                                   if self.shared_expert is not None and shared_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


# activations of ungated experts, by config name
UNGATED_ACTIVATIONS = {"relu2": lambda x: torch.square(F.relu(x)), "silu": F.silu,
                       "gelu": F.gelu}


def ungated_moe_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                          weights: torch.Tensor, ids: torch.Tensor,
                          activation: str = "relu2") -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(up_e(x_t))) with e = ids[t, j], for x [T, H], w1
    [E, I, H] (up) and w2 [E, H, I] (down): one matmul pair per expert that has tokens,
    the weighted sum in fp32, as ``moe_reference`` does for gated experts."""
    act = UNGATED_ACTIVATIONS[activation]
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    rows = x[order // top_k]
    products = torch.empty((tokens * top_k, w2.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            seg = rows[start:start + count]
            products[start:start + count] = F.linear(act(F.linear(seg, w1[expert])),
                                                     w2[expert])
            start += count
    scaled = products.float() * weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros((tokens, w2.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, order // top_k, scaled)
    return out.to(x.dtype)


def ungated_moe_dense(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor,
                      activation: str = "relu2") -> torch.Tensor:
    """``ungated_moe_reference``'s sum with every expert run over every token, each
    weighted by its share of the token's routing (zero when not chosen): sizes fixed by
    the shapes alone, no host read (what a CUDA graph may capture)."""
    act = UNGATED_ACTIVATIONS[activation]
    out = torch.zeros((x.shape[0], w2.shape[1]), dtype=torch.float32, device=x.device)
    for expert in range(w1.shape[0]):
        share = (weights.float() * (ids == expert)).sum(dim=-1, keepdim=True)  # [T, 1]
        out += share * F.linear(act(F.linear(x, w1[expert])), w2[expert]).float()
    return out.to(x.dtype)


class UngatedMoE(CustomOp):
    """Experts with plain MLPs, down(act(up(x))) (Nemotron-H: ``relu2``, ReLU squared):
    ``w1`` [E, I, H] and ``w2`` [E, H, I], from a checkpoint's per-expert tensors
    (``N.up_proj.weight`` / ``N.down_proj.weight``) or stacked ones (``up_proj`` [E, I, H]
    / ``down_proj`` [E, H, I], with or without ``.weight``); float weights only.

    ``forward(x, weights, ids)`` takes the router's choice. The native path groups the
    pairs by expert (``ungated_moe_reference``); on CUDA the same outside graph capture,
    and, while a CUDA graph is captured (no host read allowed), every expert over every
    token, each weighted by its share of the token's routing (zero when not chosen)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: str = "relu2",
                 names: tuple[str, str] = ("up_proj", "down_proj")) -> None:
        super().__init__()
        if activation not in UNGATED_ACTIVATIONS:
            raise ConfigError(f"unknown expert activation {activation!r}; supported: "
                              f"{sorted(UNGATED_ACTIVATIONS)}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.names = names
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size),
                               requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                               requires_grad=False)
        self._filled: set[tuple[int, int]] = set()  # (expert, projection) loaded

    def load_expert_tensor(self, rest: str, tensor: torch.Tensor, name: str) -> None:
        """Checkpoint tensor ``name``, ``rest`` its part under this layer."""
        parts = rest.split(".")
        expert: int | None = None
        if parts[0].isdigit():
            expert, parts = int(parts[0]), parts[1:]
            if expert >= self.num_experts:
                raise ValueError(f"checkpoint tensor {name!r} names expert {expert}; the "
                                 f"config has {self.num_experts}")
        if parts[0] not in self.names or parts[1:] not in ([], ["weight"]) or (
                expert is not None and parts[1:] != ["weight"]):
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        FusedMoE._check_float(True, tensor, name)
        proj = self.names.index(parts[0])
        dest = (self.w1, self.w2)[proj].data
        FusedMoE._copy(dest if expert is None else dest[expert], tensor, name)
        experts = range(self.num_experts) if expert is None else (expert,)
        self._filled.update((e, proj) for e in experts)

    def missing(self) -> list[str]:
        return [f"{e}.{self.names[p]}.weight" for e in range(self.num_experts)
                for p in range(2) if (e, p) not in self._filled]

    def forward_native(self, x: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        return ungated_moe_reference(x, self.w1, self.w2, weights, ids, self.activation)

    def forward_cuda(self, x: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
        if not torch.cuda.is_current_stream_capturing():
            return self.forward_native(x, weights, ids)
        return ungated_moe_dense(x, self.w1, self.w2, weights, ids, self.activation)
