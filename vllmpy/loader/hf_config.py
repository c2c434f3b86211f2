"""Reading a Hugging Face model directory's config files.

``config.json`` is required and must parse; ``generation_config.json`` is optional and a
broken one is ignored, since it only adds stop ids.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# The dtypes a weight may be loaded in, by the name used on the command line and in
# config.json's ``torch_dtype`` / ``dtype``.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPES)


def read_hf_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the parsed ``config.json`` of ``model_dir``.

    Raises ValueError naming the path when the file is missing, unreadable, not JSON, or
    not a JSON object.
    """
    path = os.path.join(os.fspath(model_dir), CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} not found: a Hugging Face model directory needs a config.json "
            "(or pass a .gguf file or a Hugging Face repo id instead)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} could not be read as JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, expected an object")
    return config


def _eos_ids(value: Any) -> set[int]:
    """Normalise an ``eos_token_id`` entry (int, list of ints, or None) to a set."""
    if value is None or isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def config_eos_ids(hf_config: dict[str, Any]) -> set[int]:
    """The stop ids named by config.json's ``eos_token_id`` (an int, a list, or absent)."""
    return _eos_ids(hf_config.get("eos_token_id"))


def read_generation_eos(model_dir: str | os.PathLike[str]) -> set[int]:
    """The stop ids in ``generation_config.json``'s ``eos_token_id`` (an int or a list).

    A missing, unreadable or malformed file gives an empty set: generation_config.json is
    optional and only ever adds stop ids to those of config.json.
    """
    path = os.path.join(os.fspath(model_dir), GENERATION_CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            gen_config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return set()
    if not isinstance(gen_config, dict):
        return set()
    return _eos_ids(gen_config.get("eos_token_id"))


def _checkpoint_dtype_name(hf_config: dict[str, Any]) -> str | None:
    """The dtype config.json says the weights are stored in, as a bare name, or None."""
    value = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if value is None:
        # Multimodal configs keep the language model's settings in a sub-config.
        text_config = hf_config.get("text_config")
        if isinstance(text_config, dict):
            value = text_config.get("torch_dtype") or text_config.get("dtype")
    if value is None:
        return None
    name = str(value)
    return name.removeprefix("torch.")


def resolve_torch_dtype(
    hf_config: dict[str, Any], requested: str, device_type: str = "cuda"
) -> torch.dtype:
    """Turn ``--dtype`` into the torch dtype the model is built and loaded in.

    The rule:
      * ``float32`` / ``bfloat16`` / ``float16`` are used as asked, on any device.
      * ``auto`` uses the dtype the checkpoint was saved in (config.json ``torch_dtype``,
        or ``dtype`` in newer configs), on any device: a float16 or bfloat16 checkpoint
        stays in that dtype on the CPU too, and a float32 checkpoint stays float32.
      * ``auto`` with no dtype in the config gives float32 on ``device_type == "cpu"``
        and bfloat16 on an accelerator.
      * ``auto`` with a config dtype other than those three (e.g. "float64") is refused:
        pass ``--dtype`` explicitly.

    Anything else for ``requested`` is refused with the list of choices.
    """
    if requested not in DTYPE_CHOICES:
        raise ValueError(
            f"unsupported --dtype {requested!r}; choose one of {', '.join(DTYPE_CHOICES)}"
        )
    if requested != "auto":
        return DTYPES[requested]
    name = _checkpoint_dtype_name(hf_config)
    if name is None:
        return torch.float32 if device_type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(
            f"config.json says the checkpoint dtype is {name!r}, which --dtype auto cannot "
            f"use; pass --dtype as one of {', '.join(DTYPES)}"
        )
    return DTYPES[name]


HF_QUANT_CONFIG_FILE = "hf_quant_config.json"


def declared_kv_cache_quant_algo(
    hf_config: dict[str, Any], model_dir: str | os.PathLike[str] | None
) -> tuple[str, str] | None:
    """The KV-cache quantization a checkpoint declares, as ``(algorithm, where)``, or None.

    Looked for in config.json ``quantization_config.kv_cache_quant_algo`` first, then in a
    standalone ``hf_quant_config.json`` next to it (``{"quantization":
    {"kv_cache_quant_algo": ...}}``, as ModelOpt writes it). ``where`` names the file and
    key the value came from. A null value declares nothing. An ``hf_quant_config.json`` that
    is present but unreadable is refused naming its path: it may change how the cache is
    stored, so it is never skipped silently.
    """
    quant = hf_config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("kv_cache_quant_algo") is not None:
        return (str(quant["kv_cache_quant_algo"]),
                f"{CONFIG_FILE} quantization_config.kv_cache_quant_algo")
    if model_dir is None:
        return None
    path = os.path.join(os.fspath(model_dir), HF_QUANT_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} could not be read as JSON: {e}") from e
    quant = data.get("quantization") if isinstance(data, dict) else None
    if isinstance(quant, dict) and quant.get("kv_cache_quant_algo") is not None:
        return (str(quant["kv_cache_quant_algo"]),
                f"{HF_QUANT_CONFIG_FILE} quantization.kv_cache_quant_algo")
    return None
