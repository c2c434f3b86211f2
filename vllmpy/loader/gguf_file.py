"""A lean GGUF file reader: metadata decoded once into a dict, tensors as memory-mapped
byte views.

The ``gguf`` package's reader builds one numpy view per string of the vocabulary and
merge lists (~300k objects for a Qwen vocabulary), which dominates start-up; this reader
decodes those arrays straight into Python lists. Dequantization still uses the ``gguf``
package. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS = {  # value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost (contiguous) dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # raw bytes, uint8 [rows, bytes_per_row], read-only memory map

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:  # numeric arrays in one go
                dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        raise GGUFFormatError(f"unknown GGUF value type {vtype} at byte {self.pos}")


class GGUFFile:
    """``metadata``: every key/value pair, decoded; ``tensors``: tensor views in file order."""

    def __init__(self, path: str) -> None:
        self.path = path
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(mm)  # type: ignore[arg-type]
        if bytes(buf[:4]) != _MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file (bad magic)")
        cur = _Cursor(buf)
        cur.pos = 4
        try:
            infos = self._read_header(cur)
        except (struct.error, ValueError) as e:  # a header cut short reads past the end
            if isinstance(e, GGUFFormatError):
                raise
            raise GGUFFormatError(f"{path} is truncated or corrupt: its header ends at byte "
                                  f"{cur.pos} of {len(buf)} ({e})") from None
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // align) * align
        self.tensors = [self._tensor(mm, data_start, *info) for info in infos]

    def _read_header(self, cur: _Cursor) -> list[tuple[str, tuple[int, ...], int, int]]:
        """Version, metadata (into ``self.metadata``) and the tensor infos."""
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported "
                                  f"(2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
            ttype, offset = cur.scalar("<I"), cur.scalar("<Q")
            infos.append((name, shape, ttype, offset))
        return infos

    def _tensor(self, mm: np.ndarray, data_start: int, name: str, shape: tuple[int, ...],
                ttype: int, offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"{self.path}: tensor {name!r} has unknown type {ttype}") \
                from None
        row = shape[0] if shape else 1
        rows = 1
        for d in shape[1:]:
            rows *= d
        row_bytes = row // block * type_size
        start = data_start + offset
        end = start + rows * row_bytes
        if end > len(mm):
            raise GGUFFormatError(f"{self.path} is truncated: tensor {name!r} needs bytes "
                                  f"{start}..{end} but the file has {len(mm)} bytes")
        data = mm[start:end].reshape(rows, row_bytes)
        return GGUFTensor(name, shape, qtype, data)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf_file(path: str) -> GGUFFile:
    """Open (or reuse an already opened) GGUF file."""
    st = os.stat(path)
    return _open_cached(os.path.abspath(path), st.st_mtime_ns, st.st_size)
