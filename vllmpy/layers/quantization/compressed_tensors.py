"""compressed-tensors checkpoints (llm-compressor's output): ``quant_method:
compressed-tensors`` with one or more ``config_groups`` targeting ``Linear``.

Schemes run here:

* ``float-quantized`` / ``naive-quantized`` FP8 W8A8: weights 8-bit float, strategy
  ``channel`` (``weight_scale`` [N, 1]) or ``tensor`` (one element); activations 8-bit
  float, dynamic per token, or static per tensor (``input_scale``) — ``Fp8LinearMethod``;
* ``pack-quantized`` W4A16: weights 4-bit int, strategy ``group`` (32 / 64 / 128) or
  ``channel``, symmetric or not, no activation quantization. ``weight_packed`` int32
  [N, K / 8] (word [n, j] holds inputs 8j .. 8j + 7 in nibbles 0..7, the unsigned code
  q; compressed-tensors' signed value is q - 8), ``weight_scale`` [N, K / G],
  ``weight_zero_point`` int32 [N / 8, K / G] when asymmetric (packed along the outputs),
  ``weight_shape`` [2].

Anything else in a scheme (another bit width, type, strategy, an actorder, a sparsity or
transform config, a target that is not ``Linear``) is refused naming the key and value.
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
from vllmpy.layers.quantization.w4a16 import Int4Method, check_group, unpack_nibbles

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear

FORMATS = ("float-quantized", "naive-quantized", "pack-quantized")


class PackQuantizedMethod(Int4Method):
    name = "compressed-tensors pack-quantized"

    def layout(self, layer: Linear):
        n, k = layer.output_size, layer.input_size
        g = self.group_size(layer)
        tensors = [("weight_packed", (n, -(-k // 8)), torch.int32, 0, 1, False),
                   ("weight_scale", (n, k // g), torch.float32, 0, 1, False),
                   ("weight_shape", (len(layer.shard_offsets) or 1, 2), torch.int64, 0, 1,
                    True)]
        if not self.symmetric:
            tensors.append(("weight_zero_point", (-(-n // 8), k // g), torch.int32, 0, 8,
                            False))
        return tensors

    def unpack(self, layer: Linear):
        k = layer.input_size
        codes = unpack_nibbles(layer.weight_packed, 1)[:, :k].contiguous()
        zeros = None
        if not self.symmetric:
            zeros = unpack_nibbles(layer.weight_zero_point, 0)[:layer.output_size]
            zeros = zeros.contiguous()
        return codes, layer.weight_scale, zeros


def _scheme(group: dict, where: str) -> tuple[str, dict]:
    """('fp8' | 'w4a16', the weights section) of one config group, checked."""
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise QuantizationError(f"{where}: targets={targets!r} is not supported (['Linear'])")
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    if group.get("output_activations"):
        raise QuantizationError(f"{where}: output_activations are not supported")
    bits, kind = weights.get("num_bits"), weights.get("type")
    for key in ("actorder", "block_structure"):
        if weights.get(key) not in (None, False):
            raise QuantizationError(f"{where}: weights.{key}={weights[key]!r} is not "
                                    "supported")
    if weights.get("dynamic"):
        raise QuantizationError(f"{where}: weights.dynamic=true is not supported")
    if bits == 8 and kind == "float":
        if weights.get("strategy") not in ("channel", "tensor"):
            raise QuantizationError(f"{where}: weights.strategy="
                                    f"{weights.get('strategy')!r} is not supported for fp8; "
                                    "supported: ['channel', 'tensor']")
        if not acts:
            raise QuantizationError(f"{where}: fp8 weights without input_activations "
                                    "(W8A16) are not supported")
        if acts.get("num_bits") != 8 or acts.get("type") != "float":
            raise QuantizationError(f"{where}: input_activations {acts.get('num_bits')}-bit "
                                    f"{acts.get('type')} are not supported with fp8 weights")
        dynamic = bool(acts.get("dynamic"))
        strategy = acts.get("strategy")
        if (dynamic and strategy != "token") or (not dynamic and strategy != "tensor"):
            raise QuantizationError(f"{where}: input_activations strategy={strategy!r} "
                                    f"dynamic={dynamic} is not supported (dynamic per "
                                    "token, or static per tensor)")
        return "fp8", weights
    if bits == 4 and kind == "int":
        if acts:
            raise QuantizationError(f"{where}: 4-bit weights with quantized "
                                    "input_activations (W4A8) are not supported")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise QuantizationError(f"{where}: weights.strategy={strategy!r} is not "
                                    "supported for int4; supported: ['group', 'channel']")
        if strategy == "group":
            check_group(int(weights.get("group_size") or 0), "weights.group_size", where)
        return "w4a16", weights
    raise QuantizationError(f"{where}: weights of {bits}-bit {kind} are not supported "
                            "(8-bit float, 4-bit int)")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, fmt: str, kind: str, weights: dict, acts: dict | None,
                 ignore: list[str]) -> None:
        super().__init__()
        self.fmt = fmt
        self.kind = kind
        self.weights = weights
        self.acts = acts or {}
        self.ignore = ignore

    @classmethod
    def from_checkpoint(cls, section: dict, where: str) -> CompressedTensorsConfig:
        fmt = section.get("format")
        if fmt not in FORMATS:
            raise QuantizationError(f"{where}: format={fmt!r} is not supported; supported: "
                                    f"{list(FORMATS)}")
        for key in ("sparsity_config", "transform_config"):
            if section.get(key):
                raise QuantizationError(f"{where}: {key} is not supported")
        if section.get("kv_cache_scheme"):
            raise QuantizationError(f"{where}: kv_cache_scheme is not supported; use "
                                    "--kv-cache-dtype")
        groups = section.get("config_groups") or {}
        if len(groups) != 1:
            raise QuantizationError(f"{where}: {len(groups)} config_groups; one scheme per "
                                    "checkpoint is supported")
        (name, group), = groups.items()
        kind, weights = _scheme(group, f"{where} config_groups.{name}")
        if (kind == "w4a16") != (fmt == "pack-quantized"):
            raise QuantizationError(f"{where}: format={fmt!r} does not hold "
                                    f"{'int4' if kind == 'w4a16' else 'fp8'} weights")
        return cls(fmt, kind, weights, group.get("input_activations"),
                   list(section.get("ignore") or []))

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        if self.kind == "fp8":
            check_fp8_device(device, "compressed-tensors fp8")

    def linear_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        head = layer_name == "lm_head" or layer_name.endswith(".lm_head")
        if ignored(layer_name, self.ignore):
            return Fp8HeadMethod(self.model_dtype) if head else DenseMethod()
        if self.kind == "fp8":
            return Fp8LinearMethod(
                "channel" if self.weights["strategy"] == "channel" else "tensor",
                "dynamic" if self.acts.get("dynamic") else "static",
                model_dtype=self.model_dtype)
        group = -1 if self.weights["strategy"] == "channel" else int(self.weights["group_size"])
        return PackQuantizedMethod(group, bool(self.weights.get("symmetric", True)),
                                   self.model_dtype)
