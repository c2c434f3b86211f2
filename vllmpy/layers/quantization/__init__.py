"""Quantized weights: which format a checkpoint declares, and the method of each layer.

``quantization_config(...)`` reads the declaration once, at configuration (config.json's
``quantization_config.quant_method``, ``hf_quant_config.json``, a GGUF file, or
``--quantization``); ``quantize_model`` gives every ``Linear`` its method (and every MoE
layer its experts' method, where the format has one) before storage is allocated. A format is one module here and one line in ``METHODS``; a format the engine
does not run is refused by name (``REFUSED``), never misread.
"""

from __future__ import annotations

import importlib
import json
import os

from torch import nn

from vllmpy.layers.quantization.base import (
    LinearMethod,
    MoEMethod,
    QuantizationConfig,
    QuantizationError,
    is_router,
)

__all__ = ["LinearMethod", "MoEMethod", "QuantizationConfig", "QuantizationError", "METHODS",
           "quantization_config", "quantize_model"]

# quant_method -> "module:class" of its QuantizationConfig (``from_checkpoint(dict, where)``)
METHODS: dict[str, str] = {
    "gguf": "vllmpy.layers.quantization.gguf:GGUFConfig",
    "fp8": "vllmpy.layers.quantization.fp8:Fp8Config",
    "compressed-tensors": "vllmpy.layers.quantization.compressed_tensors:"
                          "CompressedTensorsConfig",
    "modelopt": "vllmpy.layers.quantization.modelopt:ModelOptConfig",
    "awq": "vllmpy.layers.quantization.awq:AWQConfig",
    "gptq": "vllmpy.layers.quantization.gptq:GPTQConfig",
    "mxfp4": "vllmpy.layers.quantization.mxfp4:Mxfp4Config",
}

# formats recognised and refused: quant_method -> why
REFUSED: dict[str, str] = {
    "bitsandbytes": "bitsandbytes 4/8-bit weights are not supported",
    "nvfp4": "NVFP4 weights are not supported yet",
    "exl2": "EXL2 weights are not supported",
    "exl3": "EXL3 weights are not supported yet",
    "hqq": "HQQ weights are not supported",
    "aqlm": "AQLM weights are not supported",
    "quark": "Quark weights are not supported",
    "torchao": "torchao weights are not supported",
    "bitnet": "BitNet weights are not supported",
    "fbgemm_fp8": "FBGEMM FP8 weights are not supported",
    "eetq": "EETQ weights are not supported",
    "higgs": "HIGGS weights are not supported",
    "vptq": "VPTQ weights are not supported",
    "spqr": "SpQR weights are not supported",
}

HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's declaration beside config.json


def _load(method: str) -> type[QuantizationConfig]:
    module, _, cls = METHODS[method].partition(":")
    return getattr(importlib.import_module(module), cls)


def _declared(hf_config: dict, model_dir: str | None) -> tuple[str, dict, str] | None:
    """(quant_method, its section, where it was read) of an HF checkpoint, or None."""
    section = hf_config.get("quantization_config")
    if isinstance(section, dict) and section.get("quant_method") is not None:
        return str(section["quant_method"]).lower(), section, "config.json quantization_config"
    if model_dir is not None and os.path.isfile(os.path.join(model_dir, HF_QUANT_CONFIG)):
        try:
            with open(os.path.join(model_dir, HF_QUANT_CONFIG)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            # the KV-cache resolver refuses it by name unless --kv-cache-dtype decides;
            # quantized weights behind it would be refused at load (copy_checked)
            return None
        quant = (data.get("quantization") if isinstance(data, dict) else None) or {}
        if quant.get("quant_algo") is not None:
            return "modelopt", quant, HF_QUANT_CONFIG
    return None


def quantization_config(source_kind: str, hf_config: dict, model_dir: str | None,
                        requested: str | None = None) -> QuantizationConfig | None:
    """The checkpoint's quantization (None: unquantized). ``requested`` is
    ``--quantization``: it must agree with what the checkpoint declares, or, on an
    unquantized checkpoint, names a format that quantizes at load (``fp8``)."""
    requested = None if requested in (None, "", "none", "auto") else requested.lower()
    if source_kind == "gguf":
        if requested not in (None, "gguf"):
            raise QuantizationError(f"--quantization {requested}: a GGUF file carries its own "
                                    "block types (use --quantization gguf or leave it out)")
        return _load("gguf")()
    declared = _declared(hf_config, model_dir)
    if declared is None:
        if requested is None:
            return None
        if requested == "fp8" and "fp8" in METHODS:
            return _load("fp8").online()  # type: ignore[attr-defined]
        raise QuantizationError(
            f"--quantization {requested}: the checkpoint is not quantized, and only fp8 "
            "quantizes weights at load; leave the flag out to serve it unquantized")
    method, section, where = declared
    if requested is not None and requested != method:
        raise QuantizationError(f"--quantization {requested} does not match the checkpoint's "
                                f"{where} quant_method {method!r}")
    if method in REFUSED:
        raise QuantizationError(f"{where}: quant_method {method!r}: {REFUSED[method]}")
    if method not in METHODS or method == "gguf":
        raise QuantizationError(
            f"{where}: quant_method {method!r} is not supported; supported: "
            f"{sorted(m for m in METHODS if m != 'gguf')}")
    return _load(method).from_checkpoint(section, where)  # type: ignore[attr-defined]


def quantize_model(model: nn.Module, config: QuantizationConfig | None) -> None:
    """Give every linear layer of ``model`` (built on the meta device) its method: a MoE
    router its ``router_method``, and every MoE layer its experts' method where the
    config has one (``moe_method``; None leaves the experts in the model's dtype)."""
    if config is None:
        return
    from vllmpy.layers.linear import Linear
    from vllmpy.layers.moe import FusedMoE

    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.set_method(config.router_method(name, module) if is_router(module)
                              else config.linear_method(name, module))
        elif isinstance(module, FusedMoE):
            method = config.moe_method(name, module)
            if method is not None:
                module.set_method(method)

