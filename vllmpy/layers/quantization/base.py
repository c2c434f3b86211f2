"""The quantization seam: how a linear layer holds its weight and multiplies by it.

A ``QuantizationConfig`` is read once from the checkpoint (config.json's
``quantization_config``, ``hf_quant_config.json``, or a GGUF file's tensor types) and gives
every ``Linear`` of the model its ``LinearMethod`` by the layer's name, before the model's
storage is allocated. The method then owns the layer's weight from end to end:

* ``create_weights(layer)``: register the parameters the checkpoint fills (a dense
  ``weight``; or ``weight`` + ``weight_scale``; or ``qweight`` / ``qzeros`` / ``scales``),
  each tagged with how a shard of a packed layer lands in it (``shard_view``);
* ``load(layer, suffix, tensor, shard_id, name)``: take one checkpoint tensor;
* ``finish(layer)``: after the layer's last tensor, repack for the kernels;
* ``bind(layer, device)``: choose the kernels, once;
* ``apply(layer, x)``: ``x @ W^T + b``.

A new format is one file with a config and a method, and one line in
``vllmpy.layers.quantization.registry``.

MoE layers (``vllmpy.layers.moe.FusedMoE``) take a ``MoEMethod`` for their stacked
experts the same way, from ``QuantizationConfig.moe_method``; a format without one leaves
the experts in the model's dtype. A MoE router (a ``Linear`` marked by ``mark_router``)
takes ``QuantizationConfig.router_method``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear
    from vllmpy.layers.moe import FusedMoE


class QuantizationError(ValueError):
    """A checkpoint's quantization this engine refuses: the key and value are named."""


# the checkpoint modules a packed layer of the shared blocks stands for (``SelfAttention``,
# ``GatedMLP``): an ignore list names these, not the packed layer
PACKED_CHECKPOINT_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def checkpoint_module_names(layer_name: str) -> list[str]:
    """The checkpoint's module names behind ``layer_name`` (one, or a packed layer's)."""
    prefix, _, last = layer_name.rpartition(".")
    parts = PACKED_CHECKPOINT_MODULES.get(last)
    if parts is None:
        return [layer_name]
    return [f"{prefix}.{p}" if prefix else p for p in parts]


def tag(param: nn.Parameter, *, output_dim: int | None = 0, pack: int = 1,
        per_shard: bool = False) -> nn.Parameter:
    """Say how a shard of a packed layer lands in ``param``: rows ``offset / pack`` to
    ``(offset + size) / pack`` along ``output_dim`` (``pack`` output rows per element: 8
    for an int32 of eight 4-bit codes, 128 for a grid of 128-row block scales), or, with
    ``per_shard``, element ``i`` of a per-shard vector (a per-tensor scale of each shard),
    or the whole tensor when ``output_dim`` is None."""
    param.output_dim = output_dim  # type: ignore[attr-defined]
    param.pack = pack  # type: ignore[attr-defined]
    param.per_shard = per_shard  # type: ignore[attr-defined]
    return param


def new_param(layer: Linear, name: str, shape: tuple[int, ...], dtype: torch.dtype, *,
              output_dim: int | None = 0, pack: int = 1, per_shard: bool = False,
              keep_dtype: bool = True) -> nn.Parameter:
    """Register an uninitialised parameter ``name`` of the method on ``layer``.

    ``keep_dtype``: materialization leaves its dtype alone (fp8 weights, fp32 scales,
    int32 codes); without it a floating parameter takes the model's dtype."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.keep_dtype = keep_dtype  # type: ignore[attr-defined]
    tag(p, output_dim=output_dim, pack=pack, per_shard=per_shard)
    layer.register_parameter(name, p)
    layer.method_params.append(name)
    return p


def shard_view(layer: Linear, param: torch.Tensor, shard_id: Any, name: str) -> torch.Tensor:
    """The part of ``param`` that shard ``shard_id`` of a packed layer fills (all of it for
    an unpacked layer, or a parameter that every shard shares)."""
    if shard_id is None:
        return param
    if getattr(param, "per_shard", False):
        return param[layer.shard_index(shard_id)]
    dim = getattr(param, "output_dim", 0)
    if dim is None:
        return param
    offset, size = layer.shard_offsets[shard_id]
    pack = getattr(param, "pack", 1)
    if offset % pack or (size % pack and offset + size != layer.output_size):
        raise QuantizationError(
            f"weight {name}: shard {shard_id!r} (rows {offset}..{offset + size}) does not "
            f"align with the checkpoint's {pack}-row groups")
    start = offset // pack
    return param.narrow(dim, start, -(-(offset + size) // pack) - start)


_PLAIN = (torch.float32, torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: the start-up line's spelling."""
    return str(dtype).removeprefix("torch.")


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """``dst.copy_(src)`` after checking the shapes agree (a scalar may fill a [1]) and
    that a quantized value (fp8, packed int) goes only where that dtype is kept: copied
    into a floating parameter without its scales it would be misread."""
    if src.dtype not in _PLAIN and src.dtype != dst.dtype and \
            not hasattr(src, "quant_type"):
        raise QuantizationError(
            f"weight {name}: the checkpoint stores {src.dtype} here and the model expects "
            f"{dst.dtype}: a quantized tensor in a layer the checkpoint's quantization "
            "config does not quantize (is quantization_config missing?)")
    same = tuple(dst.shape) == tuple(src.shape) or (  # a scalar, or [2] into [1, 2]
        dst.numel() == src.numel() and dst.squeeze().shape == src.squeeze().shape)
    if not same:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not match "
                         f"the model's {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.reshape(dst.shape))


class LinearMethod:
    """Weight creation, loading and the matmul of one linear layer (one per layer)."""

    # the format's name in the start-up line, e.g. "fp8 block 128x128"
    name = "dense"

    def create_weights(self, layer: Linear) -> None:
        raise NotImplementedError

    def checkpoint_names(self, layer: Linear) -> tuple[str, ...]:
        """The tensor suffixes each shard of the layer must receive (``weight``, ...)."""
        return tuple(layer.method_params)

    def optional_names(self, layer: Linear) -> tuple[str, ...]:
        """Suffixes the checkpoint may carry or leave out (GPTQ's ``g_idx``)."""
        return ()

    def load(self, layer: Linear, suffix: str, loaded: torch.Tensor, shard_id: Any,
             name: str) -> None:
        """Copy one checkpoint tensor into its parameter (its shard of it)."""
        param = getattr(layer, suffix)
        copy_checked(shard_view(layer, param, shard_id, name), loaded, name)

    def load_dense(self, layer: Linear, weight: torch.Tensor) -> None:
        """Take a dense [out, in] weight (random weights, quantization at load); methods
        that cannot quantize refuse."""
        raise QuantizationError(f"the {self.name} method cannot quantize a dense weight")

    def finish(self, layer: Linear) -> None:
        """Every tensor of the layer is in: repack, fold scales."""

    def bind(self, layer: Linear, device: torch.device) -> None:
        """Choose this device's kernels (after materialization, before loading)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def describe(self, layer: Linear) -> str | None:
        """How the layer runs, for the start-up line; None for an unquantized layer."""
        return None

    # ---- one-row streaming -------------------------------------------------------------
    # A method whose weight the one-row streaming kernel reads (``vllmpy.ops.skinny_gemm``:
    # a dense or an fp8 weight) binds that module here on CUDA; a decode row then goes
    # through it, and the step before the layer (a norm, SiLU) may run in the same launch.

    skinny: Any = None

    def streams_one_row(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the weight-streaming kernel: one contiguous row, with
        the kernel bound."""
        return (self.skinny is not None and x.dim() == 2 and x.shape[0] == 1
                and x.stride(1) == 1)

    def stream_scale(self, layer: Linear) -> Any:
        """The ``skinny_gemm.WeightScale`` of a streamed fp8 weight; None for a dense one."""
        return None


class MoEMethod:
    """The stacked expert weights of one ``FusedMoE`` layer and its grouped products.

    * ``create_weights(layer)``: register ``w13`` [E, 2I, H] and ``w2`` [E, H, I] in the
      format's storage dtype and whatever else it keeps (scales), naming each in
      ``layer.method_params``; before materialization, in place of the float ones;
    * ``checkpoint_suffixes(layer)``: what each (expert, projection) of the checkpoint must
      carry (``weight``, ``weight_scale_inv`` ...);
    * ``load(layer, expert, projs, suffix, tensor, name)``: one checkpoint tensor: one
      expert's (``expert`` an index) or every expert's (``expert`` None, a stacked
      [E, ...] tensor), of one projection (``projs`` (0,), (1,) or (2,): gate, up, down) or
      of gate and up fused (``(0, 1)``, [E, 2I, H]); refuse by name what it cannot take;
    * ``finish(layer)``: every tensor is in (for checkpoint loads);
    * ``bind(layer, device)``: choose the kernels, once, after materialization;
    * ``apply(layer, x, weights, ids)``: the experts' weighted sum [T, H] in x's dtype;
    * ``describe(layer)``: how the experts run, for the start-up line.
    """

    name = "dense"

    def create_weights(self, layer: FusedMoE) -> None:
        raise NotImplementedError

    def checkpoint_suffixes(self, layer: FusedMoE) -> tuple[str, ...]:
        return ("weight",)

    def load(self, layer: FusedMoE, expert: int | None, projs: tuple[int, ...], suffix: str,
             tensor: torch.Tensor, name: str) -> None:
        raise NotImplementedError

    def load_dense(self, layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Take dense expert weights [E, 2I, H] / [E, H, I] (random weights)."""
        raise QuantizationError(f"the {self.name} expert method cannot quantize dense weights")

    def finish(self, layer: FusedMoE) -> None:
        """Every tensor of the layer is in: repack, dequantize for the CPU."""

    def bind(self, layer: FusedMoE, device: torch.device) -> None:
        """Choose this device's kernels (after materialization, before loading)."""

    def apply(self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def describe(self, layer: FusedMoE) -> str | None:
        return None


def mark_router(layer: Linear) -> Linear:
    """Mark ``layer`` as the router of a MoE block (the [E, H] Linear whose logits pick
    the experts), so that ``quantize_model`` gives it the config's ``router_method``."""
    layer.moe_router = True  # type: ignore[assignment]
    return layer


def is_router(layer: nn.Module) -> bool:
    return bool(getattr(layer, "moe_router", False))


class QuantizationConfig:
    """A checkpoint's quantization: the method of each linear layer (and of each MoE
    layer's experts)."""

    name = "none"

    def __init__(self) -> None:
        self.model_dtype = torch.bfloat16  # the activations' dtype (``bind_target``)

    def linear_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        raise NotImplementedError

    def router_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        """A MoE router's method (``mark_router``): by default any linear layer's."""
        return self.linear_method(layer_name, layer)

    def moe_method(self, layer_name: str, layer: FusedMoE) -> MoEMethod | None:
        """The experts' method of a MoE layer; None (the default) keeps them in the
        model's dtype, and a quantized expert tensor is then refused by name at load."""
        return None

    def bind_target(self, device: torch.device, dtype: torch.dtype) -> None:
        """Where the model runs: refused here (by name) if the format cannot run there."""
        self.model_dtype = dtype
        self.check_device(device, dtype)

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Refuse (by name) a device or activation dtype the format cannot run on."""

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors the format carries that no layer takes (none by default)."""
        return False


def ignored(layer_name: str, patterns: list[str] | None) -> bool:
    """Whether a layer is left unquantized by an ignore list of module names (exact, a
    dotted suffix, or ``re:<regex>`` as compressed-tensors writes it). A packed layer
    counts as ignored if all its checkpoint modules are, and is refused if only some are."""
    if not patterns:
        return False
    import re

    def hit(module: str) -> bool:
        for p in patterns:
            if p.startswith("re:"):
                if re.fullmatch(p[3:], module) or re.search(p[3:], module):
                    return True
            elif module == p or module.endswith("." + p) or module.startswith(p + "."):
                return True
        return False

    hits = [hit(m) for m in checkpoint_module_names(layer_name)]
    if all(hits):
        return True
    if any(hits):
        raise QuantizationError(
            f"layer {layer_name}: the checkpoint leaves some of its parts unquantized and "
            f"quantizes others ({checkpoint_module_names(layer_name)}); a packed layer "
            "takes one format")
    return False
