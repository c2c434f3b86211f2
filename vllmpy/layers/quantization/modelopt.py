"""NVIDIA ModelOpt checkpoints: ``hf_quant_config.json`` (``quantization.quant_algo``) or
config.json's ``quantization_config`` with ``quant_method: modelopt``.

``FP8`` runs here: ``weight`` fp8 [N, K], one-element ``weight_scale`` and ``input_scale``
per matrix (static activations) — ``Fp8LinearMethod``. The other algorithms ModelOpt
writes (NVFP4, MXFP4, W4A8_AWQ, INT8 SmoothQuant, ...) are refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllmpy.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ignored,
)
from vllmpy.layers.quantization.dense import DenseMethod
from vllmpy.layers.quantization.fp8 import Fp8HeadMethod, Fp8LinearMethod, check_fp8_device

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear


def _glob_to_patterns(patterns: list[str]) -> list[str]:
    """ModelOpt's exclude_modules are shell-style globs (``model.layers.*.mlp.gate``)."""
    import fnmatch

    return [f"re:{fnmatch.translate(p)}" if any(c in p for c in "*?[") else p
            for p in patterns]


class ModelOptConfig(QuantizationConfig):
    name = "modelopt"

    def __init__(self, exclude: list[str]) -> None:
        super().__init__()
        self.exclude = _glob_to_patterns(exclude)

    @classmethod
    def from_checkpoint(cls, section: dict, where: str) -> ModelOptConfig | None:
        """None when the section quantizes only the KV cache (no ``quant_algo``)."""
        algo = section.get("quant_algo")
        if algo is None:
            return None
        if str(algo).upper() != "FP8":
            raise QuantizationError(f"{where}: quant_algo={algo!r} is not supported; "
                                    "supported: ['FP8']")
        exclude = section.get("exclude_modules") or section.get("ignore") or []
        return cls(list(exclude))

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        check_fp8_device(device, "ModelOpt FP8")

    def linear_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        head = layer_name == "lm_head" or layer_name.endswith(".lm_head")
        if ignored(layer_name, self.exclude):
            return Fp8HeadMethod(self.model_dtype) if head else DenseMethod()
        return Fp8LinearMethod("tensor", "static", model_dtype=self.model_dtype)
