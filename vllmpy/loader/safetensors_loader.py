"""Weights of a Hugging Face model directory, read from its safetensors files.

A directory holds either one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Files are memory-mapped with ``safetensors.safe_open``,
so a tensor is read from disk only when it is yielded. Every file's header is checked
before the first tensor is yielded: a checkpoint with a tensor this loader does not handle
is refused whole, never loaded half-way.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype codes this loader accepts, with the torch dtype they hold. The
# floating ones are cast to the model's dtype; the others (fp8 weights, packed int4 words,
# shapes of a quantized checkpoint; an EAGLE-3 head's token maps) come as stored: a layer
# that is not quantized refuses them (``layers.quantization.base.copy_checked``).
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
QUANTIZED_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "I32": torch.int32,
    "I64": torch.int64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SUPPORTED_DTYPES = {**FLOAT_DTYPES, **QUANTIZED_DTYPES}


_CAST = frozenset(FLOAT_DTYPES.values())


def safetensors_files(model_dir: str | os.PathLike[str]) -> list[str]:
    """The safetensors files holding the weights of ``model_dir``, in load order.

    Uses the shards named by ``model.safetensors.index.json`` when present, otherwise
    ``model.safetensors``. Raises ValueError naming the directory when neither is there
    (saying so when the directory only has ``pytorch_model*.bin`` files), and naming the
    index when it is malformed or lists a shard that is missing.
    """
    model_dir = os.fspath(model_dir)
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        return _shards_from_index(index_path)
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]

    if glob.glob(os.path.join(model_dir, "pytorch_model*.bin")):
        raise ValueError(
            f"{model_dir} has only pytorch_model*.bin weights: .bin checkpoints are not "
            "supported; use a checkpoint with .safetensors weights (or a .gguf file)"
        )
    others = sorted(
        os.path.basename(p) for p in glob.glob(os.path.join(model_dir, "*.safetensors"))
    )
    if others:
        raise ValueError(
            f"{model_dir} has safetensors files {others} but neither {SINGLE_FILE} nor "
            f"{INDEX_FILE} to say which hold the model's weights"
        )
    raise ValueError(
        f"{model_dir} has no safetensors weights (expected {SINGLE_FILE} or {INDEX_FILE})"
    )


def _shards_from_index(index_path: str) -> list[str]:
    """The shard files named in a ``model.safetensors.index.json``'s ``weight_map``."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except (
        OSError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        AttributeError,
    ) as e:
        raise ValueError(f"{index_path} is not a valid safetensors index: {e!r}") from e
    if not shard_names:
        raise ValueError(f"{index_path} lists no weights in its weight_map")
    model_dir = os.path.dirname(index_path)
    shards = [os.path.join(model_dir, name) for name in shard_names]
    for shard in shards:
        if not os.path.isfile(shard):
            raise ValueError(f"{index_path} lists shard {shard}, which is missing")
    return shards


def check_safetensors_headers(files: list[str]) -> int:
    """Check every tensor in ``files`` has a supported dtype and appears only once.

    Reads headers only. Returns the number of tensors. Raises ValueError naming the
    tensor, its file and the dtype it saw, or a tensor found in two files.
    """
    seen: dict[str, str] = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                code = f.get_slice(name).get_dtype()
                if code not in SUPPORTED_DTYPES:
                    raise ValueError(
                        f"tensor {name!r} in {path} has dtype {code}; supported: "
                        f"{', '.join(FLOAT_DTYPES)} (float32, float16, bfloat16), and in "
                        f"quantized checkpoints {', '.join(QUANTIZED_DTYPES)}"
                    )
                if name in seen:
                    raise ValueError(f"tensor {name!r} is in both {seen[name]} and {path}")
                seen[name] = path
    return len(seen)


def iter_safetensors_weights(
    model_dir: str | os.PathLike[str], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint name, tensor)`` for every tensor of ``model_dir``, cast to ``dtype``.

    Tensors come file by file in shard order, each file in its stored order, on the CPU.
    All refusals (no safetensors, ``.bin`` only, an unsupported tensor dtype, a broken
    index) are raised by this call, before anything is yielded.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"weights can only be loaded in a floating dtype, not {dtype}")
    files = safetensors_files(model_dir)
    check_safetensors_headers(files)
    return _read_tensors(files, dtype)


def _open(path: str) -> Any:
    """``safe_open``, with a file it cannot read (truncated, corrupt, unreadable) refused
    naming the file and its size."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        try:
            size = f"{os.path.getsize(path)} bytes"
        except OSError:
            size = "unreadable"
        raise ValueError(f"cannot read safetensors file {path} ({size}): it is truncated or "
                         f"corrupt: {e}") from None


def _read_tensors(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with _open(path) as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                if tensor.dtype in _CAST:
                    tensor = tensor.to(dtype)
                yield name, tensor
