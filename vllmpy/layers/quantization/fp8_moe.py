"""FP8 (e4m3) MoE experts of ``quant_method: fp8`` checkpoints.

``experts.N.{gate,up,down}_proj.weight`` e4m3 with a
per-tensor ``weight_scale`` or block ``weight_scale_inv`` each (also stacked [E, ...] and
fused ``gate_up_proj`` / ``gate_up_proj_scale_inv`` spellings). They are held stacked as
``w13`` [E, 2I, H] / ``w2`` [E, H, I] e4m3 with fp32 ``w13_scale`` / ``w2_scale``: per
tensor [E, 2] (gate and up keep their own scales: nothing is requantized) and [E]; per
block [E, 2 * ceil(I / bn), ceil(H / bk)] (the gate's grid, then the up's) and
[E, ceil(H / bn), ceil(I / bk)]. They run weight-only (activations in the model's dtype)
in ``vllmpy.ops.fused_moe``'s grouped GEMMs on CUDA, and dequantized at load on the CPU.
Routers stay in the model's dtype, as vLLM keeps them; static activation scales for
experts are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from vllmpy.layers.quantization.base import (
    MoEMethod,
    QuantizationError,
    copy_checked,
    dtype_name,
)
from vllmpy.layers.quantization.fp8 import FP8, FP8_MAX

if TYPE_CHECKING:
    from vllmpy.layers.moe import FusedMoE


def quantize_experts(w: torch.Tensor, block: tuple[int, int] | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes [n, N, K], fp32 scales) of n dense matrices [n, N, K]: one scale per
    matrix [n], or with ``block`` one per block [n, ceil(N / bn), ceil(K / bk)]."""
    w = w.float()
    if block is None:
        scale = w.abs().amax(dim=(1, 2)).clamp(min=1e-12) / FP8_MAX  # [n]
        return (w / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    bn, bk = block
    n, rows, cols = w.shape
    gn, gk = -(-rows // bn), -(-cols // bk)
    padded = w.new_zeros(n, gn * bn, gk * bk)
    padded[:, :rows, :cols] = w
    tiles = padded.view(n, gn, bn, gk, bk)
    scale = tiles.abs().amax(dim=(2, 4)).clamp(min=1e-12) / FP8_MAX  # [n, gn, gk]
    codes = (tiles / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return codes.view(n, gn * bn, gk * bk)[:, :rows, :cols].to(FP8), scale


def dequantize_experts(codes: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """``quantize_experts``'s inverse: codes [n, N, K] times their scales, in ``dtype``."""
    if block is None:
        return (codes.float() * scale.reshape(-1, 1, 1)).to(dtype)
    bn, bk = block
    _, rows, cols = codes.shape
    full = scale.repeat_interleave(bn, 1)[:, :rows].repeat_interleave(bk, 2)[:, :, :cols]
    return (codes.float() * full).to(dtype)


class Fp8MoEMethod(MoEMethod):
    """A MoE layer's fp8 experts (see the module docstring): ``block`` None for per-tensor
    scales; ``online``: the checkpoint is dense and each expert's projection is quantized
    per tensor as it loads."""

    def __init__(self, block: tuple[int, int] | None = None, online: bool = False,
                 model_dtype: torch.dtype = torch.bfloat16) -> None:
        self.block = block
        self.online = online
        self.model_dtype = model_dtype
        self.scale_name = "weight_scale_inv" if block else "weight_scale"
        self.on_cuda = False
        self.dequantized = False  # the CPU's experts, dense after ``finish``
        self.name = f"fp8 block {block[0]}x{block[1]}" if block else "fp8 per-tensor"

    def create_weights(self, layer: FusedMoE) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "w13": ((e, 2 * i, h), FP8), "w2": ((e, h, i), FP8),
            "w13_scale": ((e, 2), torch.float32), "w2_scale": ((e,), torch.float32)}
        if self.block is not None:
            bn, bk = self.block
            shapes["w13_scale"] = ((e, 2 * -(-i // bn), -(-h // bk)), torch.float32)
            shapes["w2_scale"] = ((e, -(-h // bn), -(-i // bk)), torch.float32)
        for name, (shape, dtype) in shapes.items():
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            p.keep_dtype = True  # type: ignore[attr-defined]
            layer.register_parameter(name, p)
            layer.method_params.append(name)

    def checkpoint_suffixes(self, layer: FusedMoE) -> tuple[str, ...]:
        return ("weight",) if self.online else ("weight", self.scale_name)

    @staticmethod
    def _weight(layer: FusedMoE, expert: int | None, projs: tuple[int, ...]) -> torch.Tensor:
        i = layer.intermediate_size
        w = {(0,): layer.w13.data[:, :i], (1,): layer.w13.data[:, i:],
             (0, 1): layer.w13.data, (2,): layer.w2.data}[projs]
        return w if expert is None else w[expert]

    def _scale(self, layer: FusedMoE, expert: int | None, projs: tuple[int, ...]
               ) -> torch.Tensor:
        assert layer.w13_scale is not None and layer.w2_scale is not None
        s13, s2 = layer.w13_scale.data, layer.w2_scale.data
        if self.block is None:
            views = {(0,): s13[:, 0], (1,): s13[:, 1], (0, 1): s13, (2,): s2}
        else:
            rows = s13.shape[1] // 2
            views = {(0,): s13[:, :rows], (1,): s13[:, rows:], (0, 1): s13, (2,): s2}
        s = views[projs]
        return s if expert is None else s[expert]

    def load(self, layer: FusedMoE, expert: int | None, projs: tuple[int, ...], suffix: str,
             tensor: torch.Tensor, name: str) -> None:
        if suffix != "weight":  # a scale (fp32 or bf16 in the checkpoint)
            copy_checked(self._scale(layer, expert, projs), tensor.float(), name)
            return
        if tensor.dtype == FP8 and not self.online:
            copy_checked(self._weight(layer, expert, projs), tensor, name)
            return
        if not self.online or not tensor.is_floating_point() or tensor.dtype == FP8:
            raise QuantizationError(f"weight {name}: an {self.name} checkpoint stores "
                                    f"float8_e4m3fn expert weights; this one is {tensor.dtype}")
        dst = self._weight(layer, expert, projs)
        if tuple(tensor.shape) != tuple(dst.shape):
            copy_checked(dst, tensor, name)  # names the mismatch
        stack = tensor.to(dst.device) if expert is None else tensor.to(dst.device)[None]
        parts = stack.chunk(2, dim=1) if projs == (0, 1) else (stack,)
        for proj, part in zip(projs, parts):
            codes, scale = quantize_experts(part, None)
            self._weight(layer, expert, (proj,)).copy_(codes.reshape(
                self._weight(layer, expert, (proj,)).shape))
            self._scale(layer, expert, (proj,)).copy_(scale.reshape(
                self._scale(layer, expert, (proj,)).shape))

    def load_dense(self, layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor) -> None:
        i = layer.intermediate_size
        with torch.no_grad():
            for proj, dense in ((0,), w13[:, :i]), ((1,), w13[:, i:]), ((2,), w2):
                codes, scale = quantize_experts(dense, self.block)
                copy_checked(self._weight(layer, None, proj), codes, "experts")
                self._scale(layer, None, proj).copy_(scale)

    def finish(self, layer: FusedMoE) -> None:
        if self.on_cuda:
            return
        # the CPU runs the dequantized experts; one expert at a time bounds the temporary
        w13, w2 = self._dense(layer, self.model_dtype)
        layer.w13 = nn.Parameter(w13, requires_grad=False)
        layer.w2 = nn.Parameter(w2, requires_grad=False)
        layer.w13_scale = layer.w2_scale = None
        self.dequantized = True

    def _dense(self, layer: FusedMoE, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        w13 = torch.empty(layer.w13.shape, dtype=dtype, device=layer.w13.device)
        w2 = torch.empty(layer.w2.shape, dtype=dtype, device=layer.w2.device)
        i = layer.intermediate_size
        for e in range(layer.num_experts):
            for proj, dst in ((0,), w13[e, :i]), ((1,), w13[e, i:]), ((2,), w2[e]):
                dst.copy_(dequantize_experts(self._weight(layer, e, proj)[None],
                                             self._scale(layer, e, proj)[None],
                                             self.block, dtype)[0])
        return w13, w2

    def bind(self, layer: FusedMoE, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"

    def apply(self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
        from vllmpy.layers.moe import moe_reference

        act = (layer.activation, layer.swiglu_alpha, layer.swiglu_limit)
        if self.on_cuda:
            from vllmpy.ops.fused_moe import fused_moe

            return fused_moe(x, layer.w13, layer.w2, weights, ids, layer.w13_bias,
                             layer.w2_bias, *act, w13_scale=layer.w13_scale,
                             w2_scale=layer.w2_scale, scale_block=self.block)
        w13: torch.Tensor
        w2: torch.Tensor
        if self.dequantized:
            w13, w2 = layer.w13, layer.w2
            if w13.dtype != x.dtype:
                w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
        else:  # codes filled without a checkpoint load (random weights): per call
            w13, w2 = self._dense(layer, x.dtype)
        return moe_reference(x, w13, w2, weights, ids, layer.w13_bias, layer.w2_bias, *act)

    def describe(self, layer: FusedMoE) -> str:
        how = (f"dequantized to {dtype_name(layer.w13.dtype)} on the CPU" if self.dequantized
               else f"weight-only, {dtype_name(self.model_dtype)} activations (Triton "
                    "grouped GEMM)")
        origin = " (quantized at load)" if self.online else ""
        return f"{self.name}{origin} MoE expert layer(s) {how}"
