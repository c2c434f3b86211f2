"""The Mamba2 mixer: a selective state-space layer whose state is kept in seats between
steps (``vllmpy.core.cache_spec.RecurrentStateSpec``).

Hugging Face's parameter names: ``in_proj`` [I + conv_dim + H, hidden] (the gate z, then
the convolution's inputs x | B | C, then dt), ``conv1d.weight`` [conv_dim, 1, K] and
``conv1d.bias``, ``dt_bias``, ``A_log`` and ``D`` [H], ``norm.weight`` [I] and
``out_proj`` [hidden, I]; I = num_heads * head_dim, conv_dim = I + 2 * n_groups * d_state.

forward, for the step's tokens:
1. zxbcdt = in_proj(hidden * in_multiplier) (times the per-part multipliers, Falcon-H1);
2. x | B | C through the causal depthwise convolution and SiLU
   (``vllmpy.ops.causal_conv1d``), its window carried in the seat's ``conv`` state;
3. the SSD recurrence (``vllmpy.ops.mamba_ssd``) from the seat's ``ssm`` state, its output
   y kept in float32 (as transformers keeps it) for
4. the gated RMSNorm over n_groups groups: norm(y * silu(z)) (``norm_before_gate=False``,
   transformers' MambaRMSNormGated) or norm(y) * silu(z) (Falcon-H1's option), or no norm
   and y * silu(z) (Falcon-H1 without ``mamba_rms_norm``);
5. out_proj.

State layout per seat: ``conv`` [conv_dim, K - 1] in the model's dtype, column 0 the
oldest of the last K - 1 convolution inputs; ``ssm`` [num_heads, head_dim, d_state] in the
SSM dtype (transformers' recurrent-state layout). The engine zeroes a request's seat when
the request is added, so the layer always reads the state before the step's tokens.

On the CPU the layer runs the PyTorch paths (the host copies of the step's layout); on
CUDA the Triton kernels, which read only device tensors (CUDA-graph safe): the decode
kernel when every request of the step has one token (``max_query_len == 1``), the
variable-length one otherwise.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.core.cache_spec import RecurrentStateSpec, StateTensor
from vllmpy.layers.custom_op import CustomOp
from vllmpy.layers.linear import Linear
from vllmpy.ops.causal_conv1d import causal_conv1d_ref
from vllmpy.ops.mamba_ssd import ssd_chunked


def mamba2_state_spec(num_heads: int, head_dim: int, d_state: int, n_groups: int,
                      conv_kernel: int) -> RecurrentStateSpec:
    """What one Mamba2 layer keeps per seat (the module docstring's layout): what a
    config's ``layer_cache_specs`` lists for each of its Mamba2 layers."""
    conv_dim = num_heads * head_dim + 2 * n_groups * d_state
    return RecurrentStateSpec("mamba2", (
        StateTensor("conv", (conv_dim, conv_kernel - 1), "model"),
        StateTensor("ssm", (num_heads, head_dim, d_state), "ssm")))


class MixerRMSNormGated(nn.Module):
    """RMSNorm over ``n_groups`` equal groups of the last dimension, gated by silu(z)
    before (``norm_before_gate=False``) or after the norm; float32 inside, one rounding."""

    def __init__(self, size: int, n_groups: int, eps: float,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        self.n_groups = n_groups
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype
                ) -> torch.Tensor:
        tokens, size = x.shape
        h = x.float()
        z = F.silu(gate.float())
        if not self.norm_before_gate:
            h = h * z
        grouped = h.view(tokens, self.n_groups, size // self.n_groups)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        h = grouped.view(tokens, size) * self.weight.float()
        if self.norm_before_gate:
            h = h * z
        return h.to(out_dtype)


class _Conv1dWeights(nn.Module):
    """``conv1d.weight`` [channels, 1, K] and ``conv1d.bias`` [channels], as nn.Conv1d
    names and shapes them."""

    def __init__(self, channels: int, taps: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(channels), requires_grad=False)
                     if bias else None)


class Mamba2Mixer(CustomOp):
    """See the module docstring. ``proj_multipliers``: five scales of in_proj's parts
    (z, x, B, C, dt), Falcon-H1's muP vector; ``in_multiplier`` scales its input."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, d_state: int,
                 n_groups: int, conv_kernel: int, *, eps: float, proj_bias: bool = False,
                 out_bias: bool | None = None, conv_bias: bool = True,
                 time_step_limit: tuple[float, float] = (0.0, math.inf),
                 rms_norm: bool = True, norm_before_gate: bool = False,
                 in_multiplier: float = 1.0,
                 proj_multipliers: tuple[float, ...] | None = None) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"n_groups ({n_groups}) must divide the {num_heads} heads")
        if conv_kernel < 2:
            raise ValueError(f"the convolution kernel must have at least 2 taps, "
                             f"got {conv_kernel}")
        if proj_multipliers is not None and len(proj_multipliers) != 5:
            raise ValueError(f"proj_multipliers takes 5 scales (z, x, B, C, dt), got "
                             f"{proj_multipliers!r}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.d_state = d_state
        self.n_groups = n_groups
        self.conv_kernel = conv_kernel
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * d_state
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.in_multiplier = in_multiplier
        self.proj_multipliers = proj_multipliers
        self._proj_scale: torch.Tensor | None = None  # built on the device (bind_device)
        self.in_proj = Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads,
                              bias=proj_bias)
        self.conv1d = _Conv1dWeights(self.conv_dim, conv_kernel, conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.norm = (MixerRMSNormGated(self.intermediate_size, n_groups, eps, norm_before_gate)
                     if rms_norm else None)
        self.out_proj = Linear(self.intermediate_size, hidden_size,
                               bias=proj_bias if out_bias is None else out_bias)
        self.conv_state: torch.Tensor | None = None  # [num_seats + 1, conv_dim, K - 1]
        self.ssm_state: torch.Tensor | None = None  # [num_seats + 1, H, head_dim, d_state]

    # ---- the engine's side ----

    def cache_spec(self) -> RecurrentStateSpec:
        return mamba2_state_spec(self.num_heads, self.head_dim, self.d_state,
                                 self.n_groups, self.conv_kernel)

    def bind_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the engine's state tensors, each [num_seats + 1, *shape] (``cache_spec``)."""
        spec = {t.name: t.shape for t in self.cache_spec().tensors}
        if set(tensors) != set(spec):
            raise ValueError(f"mamba2 layer takes state tensors {sorted(spec)}, got "
                             f"{sorted(tensors)}")
        for name, shape in spec.items():
            if tensors[name].dim() != len(shape) + 1 or tuple(tensors[name].shape[1:]) != shape:
                raise ValueError(f"mamba2 state {name!r} has shape "
                                 f"{tuple(tensors[name].shape)}, expected [num_seats + 1, "
                                 f"{', '.join(map(str, shape))}]")
        self.conv_state, self.ssm_state = tensors["conv"], tensors["ssm"]

    def bind_device(self, device: torch.device) -> None:
        super().bind_device(device)
        if self.proj_multipliers is not None:
            sizes = (self.intermediate_size, self.intermediate_size,
                     self.n_groups * self.d_state, self.n_groups * self.d_state,
                     self.num_heads)
            self._proj_scale = torch.cat([torch.full((n,), m) for n, m in
                                          zip(sizes, self.proj_multipliers)]).to(
                device=self.dt_bias.device, dtype=self.dt_bias.dtype)
        if self.on_cuda:
            from vllmpy.ops import causal_conv1d, mamba_ssd

            self._conv_kernel = causal_conv1d.causal_conv1d
            self._ssd_decode = mamba_ssd.ssd_decode
            self._ssd_prefill = mamba_ssd.ssd_prefill

    # ---- forward ----

    def _project(self, hidden_states: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z [T, I], x | B | C [T, conv_dim], dt [T, H]) of in_proj's output."""
        if self.in_multiplier != 1.0:
            hidden_states = hidden_states * self.in_multiplier
        zxbcdt = self.in_proj(hidden_states)
        if self.proj_multipliers is not None:
            if self._proj_scale is None:
                raise RuntimeError("mamba2 layer used before bind_device built its "
                                   "projection multipliers")
            zxbcdt = zxbcdt * self._proj_scale
        z, xbc, dt = zxbcdt.split([self.intermediate_size, self.conv_dim, self.num_heads],
                                  dim=-1)
        return z, xbc, dt

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H, P], B and C [T, G, N] of the convolution's output."""
        tokens = xbc.shape[0]
        gn = self.n_groups * self.d_state
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        return (x.view(tokens, self.num_heads, self.head_dim),
                B.view(tokens, self.n_groups, self.d_state),
                C.view(tokens, self.n_groups, self.d_state))

    def _states(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("mamba2 layer used before its state was bound")
        return self.conv_state, self.ssm_state

    def _output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = y.reshape(y.shape[0], self.intermediate_size)
        if self.norm is not None:
            y = self.norm(y, z, dtype)
        else:
            y = (y.float() * F.silu(z.float())).to(dtype)
        return self.out_proj(y)

    def forward_native(self, hidden_states: torch.Tensor,
                       attn_metadata: AttentionMetadata) -> torch.Tensor:
        conv_state, ssm_state = self._states()
        qsl, seats = attn_metadata.query_start_loc_cpu, attn_metadata.state_indices_cpu
        if seats is None:
            raise RuntimeError("mamba2 layer needs the step's state_indices")
        z, xbc, dt = self._project(hidden_states)
        xbc = causal_conv1d_ref(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                conv_state, qsl, seats)
        x, B, C = self._split(xbc)
        y = ssd_chunked(x, dt, -torch.exp(self.A_log.float()), B, C, self.D, self.dt_bias,
                        ssm_state, qsl, seats, self.time_step_limit, out_dtype=torch.float32)
        return self._output(y, z, hidden_states.dtype)

    def forward_cuda(self, hidden_states: torch.Tensor,
                     attn_metadata: AttentionMetadata) -> torch.Tensor:
        conv_state, ssm_state = self._states()
        qsl, seats = attn_metadata.query_start_loc, attn_metadata.state_indices
        if seats is None:
            raise RuntimeError("mamba2 layer needs the step's state_indices")
        z, xbc, dt = self._project(hidden_states)
        xbc = self._conv_kernel(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                conv_state, qsl, seats)
        x, B, C = self._split(xbc)
        ssd = self._ssd_decode if attn_metadata.max_query_len == 1 else self._ssd_prefill
        y = ssd(x, dt, -torch.exp(self.A_log.float()), B, C, self.D, self.dt_bias,
                ssm_state, qsl, seats, self.time_step_limit, out_dtype=torch.float32)
        return self._output(y, z, hidden_states.dtype)
