"""W4A16: group-wise int4 weights under 16-bit activations, the part AWQ, GPTQ and
compressed-tensors ``pack-quantized`` share.

Each format registers its checkpoint's tensors (``Int4Method.layout``) and turns them,
once a layer's shards are in, into codes [N, K] in 0..15, scales [N, K / group] and zero
codes (or None for symmetric weights, zero 8), with ``w = (code - zero) * scale``. On
CUDA they are packed for ``vllmpy.ops.int4_gemm`` (a one-row GEMV for decode, a
dequantizing GEMM above); on the CPU the weight is dequantized to the model's dtype at load
(the start-up line says so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vllmpy.layers.quantization.base import (
    LinearMethod,
    QuantizationError,
    copy_checked,
    dtype_name,
    new_param,
    shard_view,
)

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear

SUPPORTED_GROUPS = (32, 64, 128, -1)


def check_group(group: int, key: str, where: str) -> None:
    if group not in SUPPORTED_GROUPS:
        raise QuantizationError(f"{where}: {key}={group} is not supported; supported: "
                                f"{list(SUPPORTED_GROUPS)}")


def unpack_nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> uint8 codes, eight per word along ``dim``: nibble i (bits 4i..4i+3)
    of word j is element 8j + i."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    w = words.movedim(dim, -1).unsqueeze(-1)  # [..., W, 1]
    codes = ((w >> shifts) & 0xF).to(torch.uint8)  # [..., W, 8]
    return codes.flatten(-2).movedim(-1, dim)


class Int4Method(LinearMethod):
    """A W4A16 layer. Subclasses declare their tensors in ``layout`` as
    (name, shape(layer), dtype, output_dim, pack) and implement ``unpack``."""

    name = "int4"

    def __init__(self, group: int, symmetric: bool, model_dtype: torch.dtype) -> None:
        self.group = group
        self.symmetric = symmetric
        self.model_dtype = model_dtype
        self.on_cuda = False
        self.packed: Any = None  # int4_gemm.Int4Packed on CUDA
        self.dense: torch.Tensor | None = None  # the CPU's dequantized weight
        self.perm: torch.Tensor | None = None  # input order of an act-order GPTQ weight

    def group_size(self, layer: Linear) -> int:
        return layer.input_size if self.group == -1 else self.group

    def layout(self, layer: Linear) -> list[tuple[str, tuple[int, ...], torch.dtype,
                                                  int | None, int, bool]]:
        """(name, shape, dtype, output_dim, pack, per_shard) of each checkpoint tensor."""
        raise NotImplementedError

    def unpack(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor,
                                             torch.Tensor | None]:
        """(codes [N, K] uint8, scales [N, K / group], zeros [N, K / group] or None)."""
        raise NotImplementedError

    def create_weights(self, layer: Linear) -> None:
        k = layer.input_size
        if k % self.group_size(layer):
            raise QuantizationError(f"layer of {k} inputs does not split into groups of "
                                    f"{self.group_size(layer)}")
        for name, shape, dtype, output_dim, pack, per_shard in self.layout(layer):
            new_param(layer, name, shape, dtype, output_dim=output_dim, pack=pack,
                      per_shard=per_shard)

    def load(self, layer: Linear, suffix: str, loaded: torch.Tensor, shard_id: Any,
             name: str) -> None:
        param = getattr(layer, suffix)
        dst = shard_view(layer, param, shard_id, name)
        if loaded.dtype.is_floating_point != param.dtype.is_floating_point:
            raise QuantizationError(f"weight {name}: {self.name} stores {param.dtype}; the "
                                    f"checkpoint has {loaded.dtype}")
        copy_checked(dst, loaded.to(param.dtype), name)

    def load_dense(self, layer: Linear, weight: torch.Tensor) -> None:
        """Random weights for a quantized config: symmetric round-to-nearest codes."""
        n, k = weight.shape
        g = self.group_size(layer)
        groups = weight.float().view(n, k // g, g)
        scale = (groups.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 7.5)
        codes = (groups / scale + 8).round().clamp(0, 15).to(torch.uint8).view(n, k)
        self._finish_unpacked(layer, codes, scale.squeeze(-1).to(torch.float16), None)

    def bind(self, layer: Linear, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"

    def finish(self, layer: Linear) -> None:
        if self.packed is not None or self.dense is not None:  # random weights: done
            return
        codes, scales, zeros = self.unpack(layer)
        self._finish_unpacked(layer, codes, scales, zeros)

    def _finish_unpacked(self, layer: Linear, codes: torch.Tensor, scales: torch.Tensor,
                         zeros: torch.Tensor | None) -> None:
        for name in layer.method_params:  # the checkpoint's packed form is not kept
            setattr(layer, name, None)
        if self.on_cuda:
            from vllmpy.ops.int4_gemm import pack_int4

            scales = scales.to(self.model_dtype if self.model_dtype != torch.float32
                               else torch.float32)
            self.packed = pack_int4(codes, scales, zeros, self.group_size(layer))
            return
        g = self.group_size(layer)
        zero = 8.0 if zeros is None else zeros.float().repeat_interleave(g, 1)
        self.dense = ((codes.float() - zero) * scales.float().repeat_interleave(g, 1)
                      ).to(self.model_dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.dense is not None:
            return F.linear(x, self.dense.to(x.dtype), layer.bias)
        from vllmpy.ops.int4_gemm import int4_linear

        return int4_linear(x, self.packed, layer.bias)

    def describe(self, layer: Linear) -> str:
        sym = "symmetric" if self.symmetric else "asymmetric"
        group = "channel" if self.group == -1 else f"group {self.group}"
        how = ("dequantized to " + dtype_name(self.model_dtype) +
               " on the CPU" if self.dense is not None
               else "run int4 (Triton GEMV / dequant-GEMM)")
        order = ", act-order" if self.perm is not None else ""
        return f"{self.name} W4A16 ({sym}, {group}{order}) layer(s) {how}"
