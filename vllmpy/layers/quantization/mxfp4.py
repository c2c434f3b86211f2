"""MXFP4 checkpoints (``quant_method: mxfp4``, the released gpt-oss models): MoE experts
stored as OCP microscaling FP4, dequantized to the model's dtype at load.

An expert tensor ``<name>`` comes as two: ``<name>_blocks`` uint8 [..., G, 16] (32 FP4 e2m1
values a group, two a byte, the low nibble first) and ``<name>_scales`` uint8 [..., G] (one
E8M0 exponent a group, biased by 127). Value = e2m1(nibble) * 2 ** (scale - 127), so the
dequantized tensor is [..., G * 32] and exact in bfloat16. Every other tensor of these
checkpoints is already dense (their ``modules_to_not_convert``: attention, routers,
embeddings, head), so every linear layer keeps the dense method; the experts run as
float experts after the family's loader has turned each block/scale pair back into its
dense tensor (``dequantize_pairs``). Kept in blocks on the GPU is not built yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from vllmpy.config import log
from vllmpy.layers.linear import Linear
from vllmpy.layers.quantization.base import LinearMethod, QuantizationConfig, QuantizationError
from vllmpy.layers.quantization.dense import DenseMethod

# the 16 values of an FP4 e2m1 nibble: sign, two exponent bits, one mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense [..., G * 32] of MXFP4 ``blocks`` uint8 [..., G, 16] and ``scales`` uint8
    [..., G]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizationError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
                                f"{scales.dtype}")
    if blocks.dim() < 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise QuantizationError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                                f"{tuple(scales.shape)} (blocks [..., G, 16], scales [..., G])")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)


def dequantize_pairs(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     transpose: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every ``<name>_blocks`` / ``<name>_scales`` pair
    replaced by the dense ``<name>`` (the last two dims swapped with ``transpose``: the
    gpt-oss experts' blocks run along the input features, their dense tensors are
    [E, in, out]); a half without its other half is refused by name."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    converted = 0
    for name, tensor in weights:
        for part, other in (("_blocks", "_scales"), ("_scales", "_blocks")):
            if name.endswith(part):
                base = name[:-len(part)]
                if base + other not in pending:
                    pending[base + part] = (name, tensor)
                    break
                _, mate = pending.pop(base + other)
                blocks, scales = (tensor, mate) if part == "_blocks" else (mate, tensor)
                try:
                    dense = dequantize_mxfp4(blocks, scales, dtype)
                except QuantizationError as e:
                    raise QuantizationError(f"checkpoint tensor {base!r}: {e}") from None
                converted += 1
                yield base, dense.transpose(-1, -2).contiguous() if transpose else dense
                break
        else:
            yield name, tensor
    if pending:
        raise QuantizationError(f"MXFP4 tensor(s) without their other half: "
                                f"{sorted(n for n, _ in pending.values())[:5]}")
    if converted:
        log(f"MXFP4 experts: {converted} tensor(s) dequantized to "
            f"{str(dtype).removeprefix('torch.')} at load (kept in blocks: not yet)")


class Mxfp4Config(QuantizationConfig):
    """``quant_method: mxfp4``: dense linear layers; the experts dequantized at load by
    the family's loader (``dequantize_pairs``)."""

    name = "mxfp4"
    KEYS = {"quant_method", "modules_to_not_convert"}

    @classmethod
    def from_checkpoint(cls, section: dict, where: str) -> Mxfp4Config:
        unknown = sorted(set(section) - cls.KEYS)
        if unknown:
            raise QuantizationError(f"{where}: mxfp4 keys {unknown} are not supported")
        return cls()

    def linear_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        return DenseMethod()
