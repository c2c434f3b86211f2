"""AWQ (AutoAWQ's GEMM layout): ``quant_method: awq``, 4 bits, ``version: gemm``.

Tensors of a layer with K inputs, N outputs and groups of G inputs:
``qweight`` int32 [K, N / 8] (word [k, j] holds outputs 8j + (0, 2, 4, 6, 1, 3, 5, 7) in
nibbles 0..7), ``qzeros`` int32 [K / G, N / 8] packed the same way, ``scales`` float16
[K / G, N]; ``w[n, k] = (q - zero) * scale`` per group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllmpy.layers.quantization.base import LinearMethod, QuantizationConfig, QuantizationError
from vllmpy.layers.quantization.base import ignored as is_ignored
from vllmpy.layers.quantization.dense import DenseMethod
from vllmpy.layers.quantization.w4a16 import Int4Method, check_group, unpack_nibbles

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear

# nibble i of an AWQ word holds output column 8j + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """[R, N / 8] int32 -> [R, N] uint8 in column order."""
    nibbles = unpack_nibbles(words, 1)  # column 8j + i holds nibble i
    r, n = nibbles.shape
    inverse = torch.tensor(sorted(range(8), key=lambda i: AWQ_ORDER[i]), device=words.device)
    return nibbles.view(r, n // 8, 8).index_select(2, inverse).reshape(r, n)


class AWQMethod(Int4Method):
    name = "awq"

    def layout(self, layer: Linear):
        n, k = layer.output_size, layer.input_size
        g = self.group_size(layer)
        return [("qweight", (k, n // 8), torch.int32, 1, 8, False),
                ("qzeros", (k // g, n // 8), torch.int32, 1, 8, False),
                ("scales", (k // g, n), torch.float16, 1, 1, False)]

    def unpack(self, layer: Linear):
        codes = unpack_awq(layer.qweight).t().contiguous()  # [N, K]
        zeros = unpack_awq(layer.qzeros).t().contiguous()  # [N, K / G]
        return codes, layer.scales.t().contiguous(), zeros


class AWQConfig(QuantizationConfig):
    name = "awq"
    KEYS = {"quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point",
            "version", "modules_to_not_convert", "backend"}

    def __init__(self, group: int, ignore: list[str] | None) -> None:
        super().__init__()
        self.group = group
        self.ignore = ignore or []

    @classmethod
    def from_checkpoint(cls, section: dict, where: str) -> AWQConfig:
        unknown = sorted(set(section) - cls.KEYS)
        if unknown:
            raise QuantizationError(f"{where}: key {unknown[0]!r} of quant_method 'awq' is "
                                    "not supported")
        bits = section.get("bits", section.get("w_bit", 4))
        if bits != 4:
            raise QuantizationError(f"{where}: bits={bits} is not supported (AWQ: 4)")
        version = str(section.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(f"{where}: version={version!r} is not supported; "
                                    "supported: ['gemm']")
        if section.get("zero_point", True) is not True:
            raise QuantizationError(f"{where}: zero_point={section['zero_point']!r} is not "
                                    "supported (AWQ GEMM stores zeros)")
        group = int(section.get("group_size", section.get("q_group_size", 128)))
        check_group(group, "group_size", where)
        return cls(group, section.get("modules_to_not_convert"))

    def linear_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        if layer_name.endswith("lm_head") or is_ignored(layer_name, self.ignore):
            return DenseMethod()  # AutoAWQ leaves the head unquantized
        return AWQMethod(self.group, symmetric=False, model_dtype=self.model_dtype)
