"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5 (``linear_attn``): a linear-attention
layer whose state is kept in seats between steps (``vllmpy.core.cache_spec``).

Hugging Face's parameter names. The input projections come in two layouts:
- Qwen3-Next (``projections="qkvz_grouped"``): ``in_proj_qkvz`` [2 key_dim + 2 value_dim,
  hidden] and ``in_proj_ba`` [2 Hv, hidden], their rows grouped by key head: for each of
  the Hk key heads its q [dk], k [dk], v and z [Hv/Hk * dv], then b and a [Hv/Hk];
- Qwen3.5 (``projections="qkv_z_b_a"``): four checkpoint matrices, ``in_proj_qkv`` (q | k |
  v), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, packed here as vLLM packs them into
  ``in_proj_qkvz`` (shards "qkv", "z") and ``in_proj_ba`` (shards "b", "a"); the
  checkpoint names map onto them with ``QWEN3_5_PACKED``.
Then ``conv1d.weight`` [conv_dim, 1, K] (no bias), ``dt_bias`` and ``A_log`` [Hv],
``norm.weight`` [dv] and ``out_proj`` [hidden, value_dim]; key_dim = Hk * dk,
value_dim = Hv * dv, conv_dim = 2 key_dim + value_dim.

forward, for the step's tokens:
1. the projections give q | k | v [T, conv_dim], z [T, Hv, dv], b and a [T, Hv];
2. q | k | v through the causal depthwise convolution and SiLU
   (``vllmpy.ops.causal_conv1d``), its window carried in the seat's ``conv`` state;
3. beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), and the gated delta rule
   (``vllmpy.ops.gated_delta``, q and k L2-normalised) from the seat's ``ssm`` state;
4. the gated RMSNorm per value head, norm(o) * w * act(z), act the checkpoint's output
   gate (silu, or sigmoid: ``output_gate_type``);
5. out_proj.

State layout per seat: ``conv`` [conv_dim, K - 1] in the model's dtype, column 0 the
oldest of the last K - 1 convolution inputs, channels in q | k | v order; ``ssm``
[Hv, dk, dv] in the SSM dtype (transformers' recurrent-state layout: S^T k reads it along
dk). The engine zeroes a request's seat when the request is added, so the layer always
reads the state before the step's tokens.

On the CPU the layer runs the PyTorch paths (the host copies of the step's layout); on
CUDA the Triton kernels, which read only device tensors (CUDA-graph safe): the decode
kernel when every request of the step has one token (``max_query_len == 1``), the
variable-length one otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.core.cache_spec import RecurrentStateSpec, StateTensor
from vllmpy.layers.custom_op import CustomOp
from vllmpy.layers.linear import Linear, PackedLinear
from vllmpy.ops.causal_conv1d import causal_conv1d_ref
from vllmpy.ops.gated_delta import gated_delta_rule_torch

PROJECTIONS = ("qkvz_grouped", "qkv_z_b_a")
# the output gate's activation by ``output_gate_type`` (swish is silu's other name)
GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}
# Qwen3.5's checkpoint names -> (packed module, shard id)
QWEN3_5_PACKED: dict[str, tuple[str, str | int]] = {
    "in_proj_qkv": ("in_proj_qkvz", "qkv"), "in_proj_z": ("in_proj_qkvz", "z"),
    "in_proj_b": ("in_proj_ba", "b"), "in_proj_a": ("in_proj_ba", "a")}


def gated_deltanet_state_spec(num_k_heads: int, num_v_heads: int, head_k_dim: int,
                              head_v_dim: int, conv_kernel: int) -> RecurrentStateSpec:
    """What one Gated DeltaNet layer keeps per seat (the module docstring's layout): what a
    config's ``layer_cache_specs`` lists for each of its linear-attention layers."""
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    return RecurrentStateSpec("gated_deltanet", (
        StateTensor("conv", (conv_dim, conv_kernel - 1), "model"),
        StateTensor("ssm", (num_v_heads, head_k_dim, head_v_dim), "ssm")))


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dimension, times ``weight``, times act(gate): transformers'
    Qwen3NextRMSNormGated (the norm before the gate, in float32, rounded to x's dtype
    before the weight and again at the end)."""

    def __init__(self, size: int, eps: float, activation: str = "silu") -> None:
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"gate activation {activation!r} is not supported; supported: "
                             f"{sorted(GATE_ACTIVATIONS)}")
        self.eps = eps
        self.act = GATE_ACTIVATIONS[activation]
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * self.act(gate.float())).to(x.dtype)


class _ConvWeights(nn.Module):
    """``conv1d.weight`` [channels, 1, K], as nn.Conv1d names and shapes it (no bias)."""

    def __init__(self, channels: int, taps: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps), requires_grad=False)
        self.bias = None


class GatedDeltaNet(CustomOp):
    """See the module docstring."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int,
                 head_k_dim: int, head_v_dim: int, conv_kernel: int, *, eps: float,
                 projections: str, gate_activation: str = "silu") -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"the {num_v_heads} value heads must be a multiple of the "
                             f"{num_k_heads} key heads")
        if conv_kernel < 2:
            raise ValueError(f"the convolution kernel must have at least 2 taps, "
                             f"got {conv_kernel}")
        if projections not in PROJECTIONS:
            raise ValueError(f"projections={projections!r}; supported: {PROJECTIONS}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel = conv_kernel
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.projections = projections
        self.in_proj_qkvz: Linear
        self.in_proj_ba: Linear
        if projections == "qkvz_grouped":
            self.in_proj_qkvz = Linear(hidden_size, self.conv_dim + self.value_dim)
            self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads)
        else:
            self.in_proj_qkvz = PackedLinear(hidden_size, {"qkv": self.conv_dim,
                                                           "z": self.value_dim})
            self.in_proj_ba = PackedLinear(hidden_size, {"b": num_v_heads, "a": num_v_heads})
        self.conv1d = _ConvWeights(self.conv_dim, conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(head_v_dim, eps, gate_activation)
        self.out_proj = Linear(self.value_dim, hidden_size)
        self.conv_state: torch.Tensor | None = None  # [num_seats + 1, conv_dim, K - 1]
        self.ssm_state: torch.Tensor | None = None  # [num_seats + 1, Hv, dk, dv]

    # ---- the engine's side ----

    def cache_spec(self) -> RecurrentStateSpec:
        return gated_deltanet_state_spec(self.num_k_heads, self.num_v_heads, self.head_k_dim,
                                         self.head_v_dim, self.conv_kernel)

    def bind_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the engine's state tensors, each [num_seats + 1, *shape] (``cache_spec``)."""
        spec = {t.name: t.shape for t in self.cache_spec().tensors}
        if set(tensors) != set(spec):
            raise ValueError(f"gated_deltanet layer takes state tensors {sorted(spec)}, got "
                             f"{sorted(tensors)}")
        for name, shape in spec.items():
            if tensors[name].dim() != len(shape) + 1 or tuple(tensors[name].shape[1:]) != shape:
                raise ValueError(f"gated_deltanet state {name!r} has shape "
                                 f"{tuple(tensors[name].shape)}, expected [num_seats + 1, "
                                 f"{', '.join(map(str, shape))}]")
        self.conv_state, self.ssm_state = tensors["conv"], tensors["ssm"]

    def bind_device(self, device: torch.device) -> None:
        super().bind_device(device)
        if self.on_cuda:
            from vllmpy.ops import causal_conv1d, gated_delta

            self._conv_kernel = causal_conv1d.causal_conv1d
            self._delta_decode = gated_delta.gated_delta_decode
            self._delta_prefill = gated_delta.gated_delta_prefill

    # ---- forward ----

    def _project(self, hidden_states: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q | k | v [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv])."""
        tokens = hidden_states.shape[0]
        qkvz, ba = self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        if self.projections == "qkv_z_b_a":
            qkv, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
            b, a = ba.split([self.num_v_heads, self.num_v_heads], dim=-1)
            return qkv, z.reshape(tokens, self.num_v_heads, self.head_v_dim), b, a
        per_k = self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        # [T, Hk, dk + dk + per_k * dv + per_k * dv] -> the four parts, each by key head
        q, k, v, z = qkvz.view(tokens, self.num_k_heads, -1).split(
            [dk, dk, per_k * dv, per_k * dv], dim=-1)
        b, a = ba.view(tokens, self.num_k_heads, 2 * per_k).split([per_k, per_k], dim=-1)
        qkv = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1),
                         v.reshape(tokens, -1)], dim=-1)
        return (qkv, z.reshape(tokens, self.num_v_heads, dv),
                b.reshape(tokens, self.num_v_heads), a.reshape(tokens, self.num_v_heads))

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta) [T, Hv] float32: the log decay and the write strength."""
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        return g, torch.sigmoid(b.float())

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [T, Hk, dk] and v [T, Hv, dv] of the convolution's output."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.view(tokens, self.num_k_heads, self.head_k_dim),
                k.view(tokens, self.num_k_heads, self.head_k_dim),
                v.view(tokens, self.num_v_heads, self.head_v_dim))

    def _states(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("gated_deltanet layer used before its state was bound")
        return self.conv_state, self.ssm_state

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        tokens = o.shape[0]
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.view(tokens, self.value_dim))

    def forward_native(self, hidden_states: torch.Tensor,
                       attn_metadata: AttentionMetadata) -> torch.Tensor:
        conv_state, ssm_state = self._states()
        qsl, seats = attn_metadata.query_start_loc_cpu, attn_metadata.state_indices_cpu
        if seats is None:
            raise RuntimeError("gated_deltanet layer needs the step's state_indices")
        qkv, z, b, a = self._project(hidden_states)
        qkv = causal_conv1d_ref(qkv, self.conv1d.weight.squeeze(1), None, conv_state, qsl,
                                seats)
        g, beta = self._gates(b, a)
        o = gated_delta_rule_torch(*self._split(qkv), g, beta, ssm_state, qsl, seats)
        return self._output(o, z)

    def forward_cuda(self, hidden_states: torch.Tensor,
                     attn_metadata: AttentionMetadata) -> torch.Tensor:
        conv_state, ssm_state = self._states()
        qsl, seats = attn_metadata.query_start_loc, attn_metadata.state_indices
        if seats is None:
            raise RuntimeError("gated_deltanet layer needs the step's state_indices")
        qkv, z, b, a = self._project(hidden_states)
        qkv = self._conv_kernel(qkv, self.conv1d.weight.squeeze(1), None, conv_state, qsl,
                                seats)
        g, beta = self._gates(b, a)
        delta = self._delta_decode if attn_metadata.max_query_len == 1 else self._delta_prefill
        o = delta(*self._split(qkv), g, beta, ssm_state, qsl, seats)
        return self._output(o, z)
