"""Independent NumPy readers of quantized checkpoint layouts, for checking what the
quantization tool writes.

Nothing here imports torch, safetensors, the engine or the tool: the safetensors file is
parsed by hand (an 8-byte little-endian header length, a JSON header of dtype, shape and
byte range per tensor, then the raw little-endian data), bf16 and e4m3 are decoded from
their bit definitions, and each format is dequantized as its publishers describe it:

* fp8 per tensor (AutoFP8's README, "Checkpoint structure"): ``weight`` e4m3 times the
  float32 scalar ``weight_scale``.
* fp8 blocks (DeepSeek-V3 / Qwen3-FP8, transformers' FineGrainedFP8): ``weight`` e4m3 times
  ``weight_scale_inv[n // B, k // B]``, B from ``weight_block_size``.
* compressed-tensors float-quantized: ``weight`` e4m3 times the per-row ``weight_scale``
  [N, 1].
* ModelOpt FP8 (ModelOpt's unified HF export): as fp8 per tensor.
* AWQ GEMM (AutoAWQ's ``WQLinear_GEMM.from_linear`` packs with order_map
  [0, 2, 4, 6, 1, 3, 5, 7]; vLLM and transformers unpack with the inverse
  AWQ_REVERSE_ORDER [0, 4, 1, 5, 2, 6, 3, 7]): ``qweight`` [K, N/8] and ``qzeros``
  [K/G, N/8] packed along N, ``scales`` [K/G, N], ``w = (q - z) * s``.
* GPTQ v1 (AutoGPTQ / GPTQModel ``checkpoint_format: gptq``): ``qweight`` [K/8, N] packed
  along K, nibbles in order; ``qzeros`` [K/G, N/8] packed along N hold ``zero - 1`` (GPTQModel's
  ``convert_gptq_v1_to_v2_format`` adds 1 to every nibble); ``g_idx`` [K] names the group of
  each input column, ``w[n, k] = (q - z[g_idx[k], n]) * s[g_idx[k], n]``.
* compressed-tensors pack-quantized (``pack_to_int32``): values offset by 8 into 0..15,
  element i of a row at bits 4i.. of the row's packed words; ``weight_packed`` [N, K/8];
  an asymmetric ``weight_zero_point`` is packed the same way along the output dimension,
  [N/8, K/G]; ``w = (q - 8 - (zp - 8)) * s``, with zp = 8 when symmetric.

The ``dequantize_*`` functions take one linear layer's tensors (their names without the
layer prefix: ``weight``, ``weight_scale`` ...) as NumPy arrays from ``read_tensors`` and
return the dense float32 weight [N, K].
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_PLAIN_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
                 "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                 "BOOL": np.bool_}
_ITEM_SIZE = {"BF16": 2, "F8_E4M3": 1, **{k: np.dtype(v).itemsize
                                          for k, v in _PLAIN_DTYPES.items()}}


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The stored dtype string (``"F8_E4M3"``, ``"I32"`` ...) and shape of every tensor."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {name: (entry["dtype"], tuple(entry["shape"])) for name, entry in header.items()}


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file; bf16 and e4m3 are decoded to float32, the other
    dtypes keep theirs."""
    raw = Path(path).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    header.pop("__metadata__", None)
    data = raw[8 + length:]
    out = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        if end - start != _ITEM_SIZE[dtype] * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{name}: {end - start} bytes for {dtype} {shape}")
        chunk = data[start:end]
        if dtype == "BF16":
            array = decode_bf16(np.frombuffer(chunk, dtype="<u2"))
        elif dtype == "F8_E4M3":
            array = decode_e4m3(np.frombuffer(chunk, dtype=np.uint8))
        else:
            array = np.frombuffer(chunk, dtype=np.dtype(_PLAIN_DTYPES[dtype]).newbyteorder("<"))
        out[name] = array.reshape(shape)
    return out


def decode_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def decode_e4m3(bits: np.ndarray) -> np.ndarray:
    """float8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    subnormal (m/8 * 2^-6); 0x7F and 0xFF are NaN, and there are no infinities."""
    table = np.empty(256, dtype=np.float32)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[byte] = np.nan
        elif exponent == 0:
            table[byte] = sign * mantissa / 8 * 2.0 ** -6
        else:
            table[byte] = sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return table[bits]


def nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [R, W] -> their 4-bit fields [R, 8W], bits 0-3 of word j first (column
    8j), bits 28-31 last (column 8j + 7)."""
    unsigned = words.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(0, 32, 4, dtype=np.int64)
    fields = (unsigned[:, :, None] >> shifts) & 0xF
    return fields.reshape(words.shape[0], -1)


# ---- FP8 --------------------------------------------------------------------------------


def dequantize_fp8_per_tensor(t: dict[str, np.ndarray]) -> np.ndarray:
    scale = t["weight_scale"]
    assert scale.size == 1
    return t["weight"].astype(np.float32) * np.float32(scale.reshape(()))


def dequantize_fp8_block(t: dict[str, np.ndarray], block: tuple[int, int]) -> np.ndarray:
    w = t["weight"].astype(np.float32)
    n, k = w.shape
    rows = np.arange(n) // block[0]
    cols = np.arange(k) // block[1]
    return w * t["weight_scale_inv"].astype(np.float32)[rows[:, None], cols[None, :]]


def dequantize_ct_fp8(t: dict[str, np.ndarray]) -> np.ndarray:
    return t["weight"].astype(np.float32) * t["weight_scale"].astype(np.float32)


# ---- int4 -------------------------------------------------------------------------------

AWQ_REVERSE_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def _awq_unpack(words: np.ndarray) -> np.ndarray:
    """AWQ words [R, W] -> codes [R, 8W] in natural column order: column 8j + c is nibble
    AWQ_REVERSE_ORDER[c] of word j."""
    fields = nibbles(words).reshape(words.shape[0], -1, 8)
    return fields[:, :, AWQ_REVERSE_ORDER].reshape(words.shape[0], -1)


def dequantize_awq(t: dict[str, np.ndarray], group_size: int) -> np.ndarray:
    codes = _awq_unpack(t["qweight"])            # [K, N]
    zeros = _awq_unpack(t["qzeros"])             # [K/G, N]
    scales = t["scales"].astype(np.float32)      # [K/G, N]
    group = np.arange(codes.shape[0]) // group_size
    w_kn = (codes - zeros[group]).astype(np.float32) * scales[group]
    return w_kn.T.copy()


def dequantize_gptq(t: dict[str, np.ndarray]) -> np.ndarray:
    qweight = t["qweight"]                        # [K/8, N], packed along K
    k = qweight.shape[0] * 8
    codes = nibbles(qweight.T).T                  # [K, N]
    zeros = nibbles(t["qzeros"]) + 1              # [K/G, N], v1 stores zero - 1
    scales = t["scales"].astype(np.float32)       # [K/G, N]
    group = t["g_idx"].astype(np.int64)
    assert group.shape == (k,)
    w_kn = (codes - zeros[group]).astype(np.float32) * scales[group]
    return w_kn.T.copy()


def dequantize_ct_w4a16(t: dict[str, np.ndarray], group_size: int) -> np.ndarray:
    n, k = (int(v) for v in t["weight_shape"])
    signed = nibbles(t["weight_packed"])[:, :k] - 8            # [N, K] in -8..7
    scales = t["weight_scale"].astype(np.float32)               # [N, K/G]
    if "weight_zero_point" in t:
        packed_zero = t["weight_zero_point"]                    # [N/8, K/G], along N
        zero = nibbles(packed_zero.T).T[:n] - 8                 # [N, K/G]
    else:
        zero = np.zeros_like(scales, dtype=np.int64)
    group = np.arange(k) // group_size
    return (signed - zero[:, group]).astype(np.float32) * scales[:, group]


# ---- whole checkpoints ------------------------------------------------------------------

# The tensor names (after the layer prefix) that mark a quantized linear layer, per format.
_MARKERS = {"fp8": "weight_scale", "fp8-block": "weight_scale_inv", "awq": "qweight",
            "gptq": "qweight", "pack-quantized": "weight_packed",
            "float-quantized": "weight_scale", "modelopt": "weight_scale"}


def checkpoint_format(directory: str | Path) -> str:
    """The format a checkpoint declares: "fp8" (per tensor), "fp8-block", "awq", "gptq",
    "float-quantized" / "pack-quantized" (compressed-tensors) or "modelopt"."""
    config = quantization_config(directory)
    method = config["quant_method"]
    if method == "fp8":
        return "fp8-block" if config.get("weight_block_size") else "fp8"
    if method == "compressed-tensors":
        return config["format"]
    return method


def quantization_config(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())["quantization_config"]


def split_layers(directory: str | Path
                 ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """A quantized checkpoint's tensors as (quantized linear layers: prefix -> their
    tensors by the name after the prefix, every other tensor by its full name)."""
    directory = Path(directory)
    marker = _MARKERS[checkpoint_format(directory)]
    tensors = read_tensors(directory / "model.safetensors")
    prefixes = {name[: -len(marker) - 1] for name in tensors if name.endswith("." + marker)}
    layers: dict[str, dict[str, np.ndarray]] = {p: {} for p in prefixes}
    others: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        prefix, _, part = name.rpartition(".")
        if prefix in prefixes:
            layers[prefix][part] = array
        else:
            others[name] = array
    return layers, others


def dequantize_checkpoint(directory: str | Path) -> dict[str, np.ndarray]:
    """The dense float32 state dict of a quantized checkpoint: each quantized linear layer's
    tensors become one ``P.weight`` [N, K]; every other tensor is returned as float32."""
    fmt, config = checkpoint_format(directory), quantization_config(directory)
    layers, others = split_layers(directory)
    dense = {name: array.astype(np.float32) for name, array in others.items()}
    for prefix, parts in layers.items():
        dense[f"{prefix}.weight"] = dequantize_layer(fmt, parts, config)
    return dense


def dequantize_layer(fmt: str, parts: dict[str, np.ndarray], config: dict) -> np.ndarray:
    """One linear layer's dense weight, for ``checkpoint_format``'s name of the format and
    the checkpoint's ``quantization_config``."""
    if fmt in ("fp8", "modelopt"):
        return dequantize_fp8_per_tensor(parts)
    if fmt == "fp8-block":
        return dequantize_fp8_block(parts, tuple(config["weight_block_size"]))
    if fmt == "float-quantized":
        return dequantize_ct_fp8(parts)
    if fmt == "awq":
        return dequantize_awq(parts, config["group_size"])
    if fmt == "gptq":
        return dequantize_gptq(parts)
    if fmt == "pack-quantized":
        weights = config["config_groups"]["group_0"]["weights"]
        return dequantize_ct_w4a16(parts, weights["group_size"])
    raise ValueError(f"unknown format {fmt!r}")


def element_scales(fmt: str, parts: dict[str, np.ndarray], config: dict) -> np.ndarray:
    """The scale each element of one linear layer's weight [N, K] was quantized with (its
    grid spacing for int4; the value e4m3 1.0 stands for, for FP8), to bound the error."""
    if fmt in ("fp8", "modelopt"):
        shape = parts["weight"].shape
        return np.full(shape, np.float32(parts["weight_scale"].reshape(())), np.float32)
    if fmt == "fp8-block":
        ones = {"weight": np.ones(parts["weight"].shape, np.float32),
                "weight_scale_inv": parts["weight_scale_inv"]}
        return dequantize_fp8_block(ones, tuple(config["weight_block_size"]))
    if fmt == "float-quantized":
        return np.broadcast_to(parts["weight_scale"].astype(np.float32),
                               parts["weight"].shape).copy()
    if fmt == "awq":
        k = parts["qweight"].shape[0]
        group = np.arange(k) // config["group_size"]
        return parts["scales"].astype(np.float32)[group].T.copy()
    if fmt == "gptq":
        return parts["scales"].astype(np.float32)[parts["g_idx"].astype(np.int64)].T.copy()
    if fmt == "pack-quantized":
        k = int(parts["weight_shape"][1])
        group_size = config["config_groups"]["group_0"]["weights"]["group_size"]
        return parts["weight_scale"].astype(np.float32)[:, np.arange(k) // group_size]
    raise ValueError(f"unknown format {fmt!r}")
