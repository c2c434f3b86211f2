"""Linear layers, including the packed forms that fuse several checkpoint matrices.

A ``Linear`` hands its weight to a quantization method (``vllmpy.layers.quantization``):
the method registers the parameters the checkpoint fills, loads them, and runs the matmul.
Every layer starts dense (``DenseMethod``); ``quantize_model`` gives each layer its
checkpoint's method by name before storage is allocated. A packed layer knows where each
checkpoint shard lands (``shard_offsets``); the method places the shard in each of its
parameters (``shard_view``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vllmpy.layers.custom_op import CustomOp
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.quantization.base import LinearMethod, copy_checked
from vllmpy.layers.quantization.dense import DenseMethod


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    """Copy ``loaded`` into ``param``; a block-quantized tensor is dequantized to its dtype."""
    if tuple(param.shape) != tuple(loaded.shape):
        copy_checked(param, loaded, name)  # names the mismatch
    dense = getattr(loaded, "dense", None)
    copy_checked(param, loaded if dense is None else dense(param.dtype), name)


class Linear(CustomOp):
    """y = x W^T (+ b), W of shape [output_size, input_size], held by ``method``."""

    shard_offsets: dict[Any, tuple[int, int]] = {}

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.bias = (nn.Parameter(torch.empty(output_size), requires_grad=False)
                     if bias else None)
        self.method_params: list[str] = []  # the parameters the method registered
        self.method: LinearMethod = DenseMethod()
        self.method.create_weights(self)
        self.device = torch.device("cpu")
        self._received: set[tuple[str, Any]] = set()

    def set_method(self, method: LinearMethod) -> None:
        """Replace the method (before materialization): its parameters replace the old."""
        for name in self.method_params:
            delattr(self, name)
        self.method_params = []
        self.method = method
        method.create_weights(self)

    # ---- kernels -----------------------------------------------------------------------

    def bind_device(self, device: torch.device) -> None:
        super().bind_device(device)
        self.device = device
        self.method.bind(self, device)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def streams_one_row(self, x: torch.Tensor) -> bool:
        """Whether x goes through the weight-streaming kernel (``skinny_gemm``: a dense or
        an fp8 weight), so that the step before it may run in the same launch."""
        return self.method.streams_one_row(x)

    @property
    def _skinny(self) -> Any:
        assert self.method.skinny is not None
        return self.method.skinny

    @property
    def stream_scale(self) -> Any:
        """The streamed weight's scales (``skinny_gemm.WeightScale``), None when dense."""
        return self.method.stream_scale(self)

    # ---- loading -----------------------------------------------------------------------

    def shard_index(self, shard_id: Any) -> int:
        return list(self.shard_offsets).index(shard_id)

    def _shard_ids(self) -> list[Any]:
        return list(self.shard_offsets) or [None]

    def load_tensor(self, suffix: str, loaded: torch.Tensor, shard_id: Any = None,
                    name: str = "") -> None:
        """One checkpoint tensor of this layer (``suffix``: ``weight``, ``bias``,
        ``weight_scale``, ``qweight``...; ``shard_id``: its place in a packed layer)."""
        if shard_id is not None and shard_id not in self.shard_offsets:
            raise ValueError(f"weight {name}: unknown shard {shard_id!r}")
        if (suffix, shard_id) in self._received or (suffix, None) in self._received:
            raise ValueError(f"weight {name}: loaded twice")
        if suffix == "bias" and self.bias is not None:
            dst = self.bias
            if shard_id is not None:
                offset, size = self.shard_offsets[shard_id]
                dst = dst.narrow(0, offset, size)
            default_weight_loader(dst, loaded, name)
        elif suffix in self.method.checkpoint_names(self) or \
                suffix in self.method.optional_names(self):
            self.method.load(self, suffix, loaded, shard_id, name)
        else:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter "
                             f"(a {self.method.name} layer takes "
                             f"{list(self.method.checkpoint_names(self))})")
        # a whole packed weight at once (GPT-2's fused c_attn) fills every shard
        self._received.update((suffix, sh) for sh in (
            [shard_id] if shard_id is not None else self._shard_ids()))
        if not self.missing():
            self.method.finish(self)

    def missing(self) -> list[str]:
        """The (suffix, shard) pairs the checkpoint has not filled yet, as names."""
        names = list(self.method.checkpoint_names(self))
        if self.bias is not None:
            names.append("bias")
        return [f"{s}[{sh}]" if sh is not None else s
                for s in names for sh in self._shard_ids()
                if (s, sh) not in self._received]

    def load_weight(self, loaded: torch.Tensor, name: str = "") -> None:
        """Load the whole weight of an unpacked layer."""
        self.load_tensor("weight", loaded, None, name)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any,
                      name: str = "") -> None:
        """Load one shard's weight (``param`` the layer's weight) or bias."""
        self.load_tensor("bias" if param is self.bias else "weight", loaded, shard_id, name)


def rms_norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(x + residual)), x + residual)``; without a residual
    ``(linear(norm(x)), x)``. A row the linear layer streams takes one launch for both
    (``rms_norm_gemm``), with the same values as the two layers one after the other."""
    if (type(norm) is RMSNorm and linear.streams_one_row(x) and norm.weight.dtype == x.dtype
            and (residual is None or residual.stride(-1) == 1)):
        return linear._skinny.rms_norm_gemm(x, residual, norm.weight, norm.eps, linear.weight,
                                            linear.bias, linear.stream_scale)
    if residual is None:
        return linear(norm(x)), x
    normed, residual = norm(x, residual)
    return linear(normed), residual


class PackedLinear(Linear):
    """Several checkpoint matrices stacked along the output dimension.

    ``shards`` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its output size; the order of
    the mapping is the order of the rows."""

    def __init__(self, input_size: int, shards: dict[str | int, int], bias: bool = False) -> None:
        offsets: dict[Any, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards.items():
            offsets[shard_id] = (offset, size)
            offset += size
        self.shard_offsets = offsets  # set first: the method's parameters are per shard
        super().__init__(input_size, offset, bias)


def tie_quantized_lm_head(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
    embedding: str = "model.embed_tokens",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass a tied model's checkpoint through; if its embedding comes block-quantized and
    the quantization method has a kernel for the head in that type on this device, give
    the model an ``lm_head`` that runs on the embedding's blocks (``tied_head``)."""
    embed = model.get_submodule(embedding)
    for name, tensor in weights:
        if name == f"{embedding}.weight" and hasattr(tensor, "quant_type"):
            from vllmpy.layers.quantization.gguf import tied_head

            head = tied_head(embed, tensor)
            if head is not None:
                model.lm_head = head
        yield name, tensor


def describe_quantized_layers(model: nn.Module) -> str | None:
    """One line on how the linear layers (and MoE experts) that came quantized run, or None
    if none did."""
    counts: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, Linear):
            how = module.method.describe(module)
        else:  # a MoE layer's experts describe themselves (``FusedMoE.describe_experts``)
            describe = getattr(module, "describe_experts", None)
            how = describe() if describe is not None else None
        if how is not None:
            counts[how] += 1
    if not counts:
        return None
    parts = [f"{n} {how}" for how, n in sorted(counts.items())]
    return "quantized linear weights: " + "; ".join(parts)
