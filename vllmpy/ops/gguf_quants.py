"""GGUF block-quantized matrices: their block layouts, a vectorised dequantizer, and the
planar form the matmul kernels of ``vllmpy.ops.gguf_gemm`` read.

A GGUF matrix is stored row by row; each row is a run of blocks along the input dimension
(``BLOCK_SIZES``: 32 weights per block for the legacy types and IQ4_NL, 256 for the
k-quants and IQ4_XS). Within a block, fp16 scales are mixed with the codes. Byte ranges
below are within one block; "nibble" codes are 4-bit, low nibble first.

* ``Q4_0`` (18): d, qs[16].   Byte j holds q[j] (low) and q[j + 16] (high); w = d * (q - 8).
* ``Q4_1`` (20): d, m, qs[16]; w = d * q + m.
* ``Q5_0`` (22): d, qh[4], qs[16]. Bit j of the little-endian uint32 qh is bit 4 of q[j];
  w = d * (q - 16).
* ``Q5_1`` (24): d, m, qh[4], qs[16]; w = d * q + m.
* ``Q8_0`` (34): d, qs[32] int8; w = d * q.
* ``IQ4_NL`` (18): d, qs[16] as Q4_0; w = d * IQ4_VALUES[q].
* ``Q2_K`` (84): scales[16], qs[64], d, dmin. Element e = 128 h + 32 s + j (h < 2, s < 4,
  j < 32) is bits 2s..2s+1 of qs[32 h + j]; its group of 16 is g = e // 16, with
  scales[g] = (sc low nibble, min high nibble); w = d * sc * q - dmin * min.
* ``Q3_K`` (110): hmask[32], qs[64], scales[12], d. Low two bits as Q2_K; bit (4 h + s) of
  hmask[j] is bit 2 of q; w = d * (sc - 32) * (q - 4). The 16 6-bit scales: the low four
  bits of scale i are nibble i // 8 of scales[i % 8], the high two are bits
  2 (i // 4)..2 (i // 4) + 1 of scales[8 + i % 4].
* ``Q4_K`` (144): d, dmin, scales[12], qs[128]. Sub-block i (32 weights, i < 8) is the low
  (even i) or high (odd i) nibbles of qs[32 (i // 2):32 (i // 2) + 32];
  w = d * sc[i] * q - dmin * min[i], with the 6-bit sc and min packed in scales[12]: for
  i < 4, sc = scales[i] & 63 and min = scales[i + 4] & 63; for i >= 4,
  sc = (scales[i + 4] & 15) | (scales[i - 4] >> 6) << 4 and
  min = (scales[i + 4] >> 4) | (scales[i] >> 6) << 4.
* ``Q5_K`` (176): d, dmin, scales[12], qh[32], qs[128]: Q4_K plus bit i of qh[j] as bit 4
  of element j of sub-block i.
* ``Q6_K`` (210): ql[128], qh[64], scales[16] int8, d. Element e = 128 h + 32 s + j: its
  low four bits are nibble s // 2 of ql[64 h + 32 (s % 2) + j], its high two are bits
  2s..2s+1 of qh[32 h + j]; w = d * scales[e // 16] * (q - 32).
* ``IQ4_XS`` (136): d, scales_h (uint16), scales_l[4], qs[128]. Sub-block i (32 weights)
  is laid out as an IQ4_NL block in qs[16 i:16 i + 16]; its 6-bit scale is nibble i % 2 of
  scales_l[i // 2] with bits 2i..2i+1 of scales_h above; w = d * (scale - 32) *
  IQ4_VALUES[q].

Every weight is computed in float32 as gguf-py (and ggml) compute it, products and
differences rounded one at a time, and only then cast to the requested dtype.

``prepare`` splits the blocks into planes, one tensor per field, each [rows, ...] and
contiguous, so that a kernel loads aligned runs of one kind of byte (``GGUFWeight``). The
scales and the low bits of the codes keep GGUF's byte order; the high bits (Q5_0, Q5_1,
Q3_K, Q5_K, Q6_K) are rearranged so that the high bits of the codes in one 32-bit word of
``qs`` sit in one unit of ``qh``, at positions that depend only on the code's place in the
word (see ``_HIGH``). The planes hold exactly as many bytes as the matrix's blocks (plus a
64-byte lookup table for the IQ4 types and the split-K counters of the matmul kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# type -> (weights per block, bytes per block), as in gguf.GGML_QUANT_SIZES
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
}

# the 16 values a 4-bit IQ4_NL / IQ4_XS code stands for
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# Where each plane lies in a block: plane -> (first byte, end byte, dtype of the plane).
#   d      fp16 [rows, blocks]      the block (super-block) scale
#   dm     fp16 [rows, blocks]      Q4_1 / Q5_1 m; Q2_K / Q4_K / Q5_K dmin
#   qs     [rows, blocks * n]       the low bits of the codes (int8 for Q8_0)
#   qh     [rows, blocks * n]       their high bits as the file has them (the little-endian
#                                   uint32 of Q5_0 / Q5_1; Q3_K's hmask), rearranged by
#                                   _pack_high before they are kept
#   scales [rows, blocks * n]       the sub-block scales (int8 for Q6_K; IQ4_XS: scales_h
#                                   then scales_l)
_U8, _I8, _F16, _I32 = torch.uint8, torch.int8, torch.float16, torch.int32
_PLANES: dict[str, dict[str, tuple[int, int, torch.dtype]]] = {
    "Q4_0": {"d": (0, 2, _F16), "qs": (2, 18, _U8)},
    "Q4_1": {"d": (0, 2, _F16), "dm": (2, 4, _F16), "qs": (4, 20, _U8)},
    "Q5_0": {"d": (0, 2, _F16), "qh": (2, 6, _I32), "qs": (6, 22, _U8)},
    "Q5_1": {"d": (0, 2, _F16), "dm": (2, 4, _F16), "qh": (4, 8, _I32), "qs": (8, 24, _U8)},
    "Q8_0": {"d": (0, 2, _F16), "qs": (2, 34, _I8)},
    "IQ4_NL": {"d": (0, 2, _F16), "qs": (2, 18, _U8)},
    "Q2_K": {"scales": (0, 16, _U8), "qs": (16, 80, _U8), "d": (80, 82, _F16),
             "dm": (82, 84, _F16)},
    "Q3_K": {"qh": (0, 32, _U8), "qs": (32, 96, _U8), "scales": (96, 108, _U8),
             "d": (108, 110, _F16)},
    "Q4_K": {"d": (0, 2, _F16), "dm": (2, 4, _F16), "scales": (4, 16, _U8),
             "qs": (16, 144, _U8)},
    "Q5_K": {"d": (0, 2, _F16), "dm": (2, 4, _F16), "scales": (4, 16, _U8),
             "qh": (16, 48, _U8), "qs": (48, 176, _U8)},
    "Q6_K": {"qs": (0, 128, _U8), "qh": (128, 192, _U8), "scales": (192, 208, _I8),
             "d": (208, 210, _F16)},
    "IQ4_XS": {"d": (0, 2, _F16), "scales": (2, 8, _U8), "qs": (8, 136, _U8)},
}

QUANT_TYPES = tuple(BLOCK_SIZES)


def check_quant_type(quant_type: str) -> None:
    """Refuse a type this module has no layout for, naming the ones it has."""
    if quant_type not in BLOCK_SIZES:
        raise ValueError(f"GGUF type {quant_type!r} is not supported; "
                         f"supported: {', '.join(QUANT_TYPES)}")


def _check_geometry(blocks: torch.Tensor, quant_type: str, rows: int | None,
                    cols: int) -> torch.Tensor:
    """``blocks`` as uint8 [rows, row_bytes], after checking it fits the type and shape."""
    check_quant_type(quant_type)
    per_block, block_bytes = BLOCK_SIZES[quant_type]
    if cols <= 0 or cols % per_block != 0:
        raise ValueError(f"{quant_type} rows of {cols} weights do not split into blocks of "
                         f"{per_block}")
    if blocks.dtype != torch.uint8:
        raise ValueError(f"GGUF blocks must be uint8, not {blocks.dtype}")
    row_bytes = cols // per_block * block_bytes
    if rows is None:
        rows = blocks.numel() // row_bytes
    if blocks.numel() != rows * row_bytes:
        raise ValueError(f"{quant_type} blocks for a [{rows}, {cols}] matrix take "
                         f"{rows * row_bytes} bytes ({row_bytes} a row); got "
                         f"{tuple(blocks.shape)}")
    return blocks.reshape(rows, row_bytes)


def _split_planes(blocks: torch.Tensor, quant_type: str) -> dict[str, torch.Tensor]:
    """uint8 [rows, row_bytes] -> the type's planes (see ``_PLANES``; qh rearranged, see
    ``_HIGH``), each contiguous."""
    block_bytes = BLOCK_SIZES[quant_type][1]
    rows = blocks.shape[0]
    per_row = blocks.view(rows, -1, block_bytes)
    planes = {}
    for name, (start, end, dtype) in _PLANES[quant_type].items():
        plane = per_row[:, :, start:end].reshape(rows, -1)  # a copy unless one plane
        planes[name] = plane.contiguous().view(dtype)
    if "qh" in planes:
        nb = per_row.shape[1]
        planes["qh"] = _pack_high(quant_type, _raw_high(quant_type, planes["qh"], rows, nb),
                                  rows, nb)
    return planes


def _shifts(step: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[0, step, 2 step, ...] (count values), made on the device without a host copy."""
    return torch.arange(count, dtype=dtype, device=device) * step


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 packed bytes [..., 12] -> 6-bit (scale, min) [..., 8] each."""
    low, mid, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([low & 63, (top & 15) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


# The kept high bits. A 32-bit word of qs holds the low bits of codes at bytes k = 0..3
# and, within a byte, at part p (the nibble p, or for the 2-bit low parts of Q3_K the
# crumb p). The high bits of one qs word's codes form one unit of qh, in which the code
# at (k, p) has its high bits at a fixed place:
#   Q5_0, Q5_1: uint8 per qs word (4 per block), bit 4 p + k;
#   Q5_K:       uint8 per qs word (32 per super-block), bit 4 p + k;
#   Q6_K:       int16 per qs word (32 per super-block), bits 2 (4 p + k) and above;
#   Q3_K:       int16 per qs word (16 per super-block), bit 4 p + k.
# (type -> (bits per code, units per block, unit dtype))
_HIGH: dict[str, tuple[int, int, torch.dtype]] = {
    "Q5_0": (1, 4, torch.uint8), "Q5_1": (1, 4, torch.uint8), "Q5_K": (1, 32, torch.uint8),
    "Q6_K": (2, 32, torch.int16), "Q3_K": (1, 16, torch.int16),
}
# Each type's code index within a block, as (dims, order): the block's element index
# factored into ``dims`` (row-major), and the permutation of those dims that puts them in
# the kept order (qs word, then the (p, k) place within it):
#   Q5_0, Q5_1: element 16 p + 4 w + k;
#   Q5_K:       element 64 r + 32 p + 4 w + k (sub-block 2 r + p of qs run r);
#   Q6_K:       element 128 h + 64 p + 32 t + 16 j + 4 w + k (qs run r = (h, t, j));
#   Q3_K:       element 128 h + 32 p + 16 j + 4 w + k with p = 2 a + b (qs run (h, j)),
#               the int16 unit holding (a = 0, then a = 1) in its two bytes.
_HIGH_ORDER: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "Q5_0": ((2, 4, 4), (1, 0, 2)),  # (p, w, k) -> (w, p, k)
    "Q5_1": ((2, 4, 4), (1, 0, 2)),
    "Q5_K": ((4, 2, 8, 4), (0, 2, 1, 3)),  # (r, p, w, k) -> (r, w, p, k)
    "Q6_K": ((2, 2, 2, 2, 4, 4), (0, 2, 3, 4, 1, 5)),  # (h, p, t, j, w, k) -> (h, t, j, w, p, k)
    "Q3_K": ((2, 2, 2, 2, 4, 4), (0, 3, 4, 1, 2, 5)),  # (h, a, b, j, w, k) -> (h, j, w, a, b, k)
}


def _bit_fields(x: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """x [...] -> [..., count]: the ``width``-bit fields of x, lowest first."""
    shifts = _shifts(width, count, x.dtype, x.device)
    return (x.unsqueeze(-1) >> shifts) & ((1 << width) - 1)


def _raw_high(quant_type: str, qh: torch.Tensor, rows: int, nb: int) -> torch.Tensor:
    """The file's high bits -> uint8 [rows, nb, block_size], element by element."""
    if quant_type in ("Q5_0", "Q5_1"):  # bit j of the block's uint32 for element j
        return _bit_fields(qh.view(rows, nb), 32, 1).to(torch.uint8)
    per_block = qh.view(rows, nb, -1)
    if quant_type == "Q6_K":  # crumb s of qh[32 h + j] for element 128 h + 32 s + j
        return _bit_fields(per_block.view(rows, nb, 2, 32), 4, 2).transpose(-1, -2) \
            .reshape(rows, nb, 256)
    # Q5_K: bit i of qh[j] for element 32 i + j; Q3_K: bit 4 h + s of hmask[j] for element
    # 128 h + 32 s + j, which is the same rule
    return _bit_fields(per_block, 8, 1).transpose(-1, -2).reshape(rows, nb, 256)


def _pack_high(quant_type: str, high: torch.Tensor, rows: int, nb: int) -> torch.Tensor:
    """Per-element high bits uint8 [rows, nb, block_size] -> the kept qh plane."""
    bits, units, dtype = _HIGH[quant_type]
    dims, order = _HIGH_ORDER[quant_type]
    placed = high.view(rows, nb, *dims).permute(0, 1, *(2 + i for i in order))
    fields = placed.reshape(rows, nb, -1, 8 // bits)  # the fields of one byte each
    packed = fields[..., 0].clone()
    for i in range(1, 8 // bits):
        packed |= fields[..., i] << (bits * i)
    return packed.view(rows, -1).view(dtype)


def _unpack_high(quant_type: str, plane: torch.Tensor, rows: int, nb: int) -> torch.Tensor:
    """The kept qh plane -> per-element high bits uint8 [rows, nb, block_size]."""
    bits = _HIGH[quant_type][0]
    dims, order = _HIGH_ORDER[quant_type]
    fields = _bit_fields(plane.view(torch.uint8).view(rows, nb, -1), 8 // bits, bits)
    kept = [dims[i] for i in order]
    inverse = [order.index(i) for i in range(len(order))]
    return fields.reshape(rows, nb, *kept).permute(0, 1, *(2 + i for i in inverse)) \
        .reshape(rows, nb, -1)


def _iq4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)


def _dequantize_planes(quant_type: str, planes: dict[str, torch.Tensor], rows: int,
                       cols: int, table: torch.Tensor | None) -> torch.Tensor:
    """The planes of ``rows`` rows -> float32 [rows, cols]. ``table`` is the IQ4 value
    table (float32 [16], on the planes' device) for the IQ4 types, else unused."""
    per_block = BLOCK_SIZES[quant_type][0]
    nb = cols // per_block
    dev = planes["d"].device
    d = planes["d"].float().view(rows, nb, 1)
    dm = planes["dm"].float().view(rows, nb, 1) if "dm" in planes else None
    qs = planes["qs"]
    nibble = _shifts(4, 2, torch.uint8, dev)  # [0, 4]
    crumb = _shifts(2, 4, torch.uint8, dev)  # [0, 2, 4, 6]

    if quant_type in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"):
        q = ((qs.view(rows, nb, 1, 16) >> nibble.view(2, 1)) & 15).view(rows, nb, 32)
        if quant_type in ("Q5_0", "Q5_1"):
            q = q | (_unpack_high(quant_type, planes["qh"], rows, nb) << 4)
        if quant_type == "IQ4_NL":
            assert table is not None
            w = d * table[q.long()]
        elif quant_type == "Q4_0":
            w = d * (q.float() - 8)
        elif quant_type == "Q5_0":
            w = d * (q.float() - 16)
        else:
            assert dm is not None
            w = d * q.float() + dm
    elif quant_type == "Q8_0":
        w = qs.view(rows, nb, 32).float() * d
    elif quant_type in ("Q2_K", "Q3_K"):
        # [rows, nb, h, s, j] -> element 128 h + 32 s + j, as 16 groups of 16
        low = ((qs.view(rows, nb, 2, 1, 32) >> crumb.view(4, 1)) & 3).view(rows, nb, 16, 16)
        if quant_type == "Q2_K":
            assert dm is not None
            sc = planes["scales"].view(rows, nb, 16, 1)
            dl = d.view(rows, nb, 1, 1) * (sc & 15).float()
            ml = dm.view(rows, nb, 1, 1) * (sc >> 4).float()
            w = dl * low.float() - ml
        else:
            high = _unpack_high(quant_type, planes["qh"], rows, nb).view(rows, nb, 16, 16)
            q = (low | (high << 2)).float() - 4
            packed = planes["scales"].view(rows, nb, 12)
            lsc = (packed[..., 0:8].view(rows, nb, 1, 8) >> nibble.view(2, 1)) & 15
            hsc = (packed[..., 8:12].view(rows, nb, 1, 4) >> crumb.view(4, 1)) & 3
            sc = (lsc.view(rows, nb, 16) | (hsc.view(rows, nb, 16) << 4)).float() - 32
            w = (d.view(rows, nb, 1, 1) * sc.view(rows, nb, 16, 1)) * q
    elif quant_type in ("Q4_K", "Q5_K"):
        assert dm is not None
        q = ((qs.view(rows, nb, 4, 1, 32) >> nibble.view(2, 1)) & 15).view(rows, nb, 8, 32)
        if quant_type == "Q5_K":
            q = q | (_unpack_high(quant_type, planes["qh"], rows, nb).view(rows, nb, 8, 32) << 4)
        sc, mn = _k_scales(planes["scales"].view(rows, nb, 12))
        big_d = (d * sc.float()).view(rows, nb, 8, 1)
        big_m = (dm * mn.float()).view(rows, nb, 8, 1)
        w = big_d * q.float() - big_m
    elif quant_type == "Q6_K":
        # ql: [rows, nb, h, nibble, 64], element order
        low = ((qs.view(rows, nb, 2, 1, 64) >> nibble.view(2, 1)) & 15).view(rows, nb, 256)
        high = _unpack_high(quant_type, planes["qh"], rows, nb)
        q = (low | (high << 4)).float() - 32
        big_d = d * planes["scales"].view(rows, nb, 16).float()
        w = big_d.view(rows, nb, 16, 1) * q.view(rows, nb, 16, 16)
    else:  # IQ4_XS
        assert table is not None
        packed = planes["scales"].view(rows, nb, 6)
        high_word = packed[..., 0].to(torch.int32) | (packed[..., 1].to(torch.int32) << 8)
        hsc = (high_word.view(rows, nb, 1) >> _shifts(2, 8, torch.int32, dev)) & 3
        lsc = ((packed[..., 2:6].view(rows, nb, 4, 1) >> nibble) & 15).view(rows, nb, 8)
        sc = (lsc.to(torch.int32) | (hsc << 4)).float() - 32
        q = ((qs.view(rows, nb, 8, 1, 16) >> nibble.view(2, 1)) & 15).view(rows, nb, 8, 32)
        w = (d * sc).view(rows, nb, 8, 1) * table[q.long()]
    return w.reshape(rows, cols)


def dequantize(blocks: torch.Tensor, quant_type: str, cols: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGUF blocks, uint8 [rows, row_bytes] (row r: the blocks of output row r, as the file
    stores them), -> [rows, cols] of ``dtype``, on the blocks' device. Computed in float32
    as gguf-py computes it, then cast once."""
    blocks = _check_geometry(blocks, quant_type, None, cols)
    rows = blocks.shape[0]
    table = _iq4_table(blocks.device) if quant_type.startswith("IQ4") else None
    w = _dequantize_planes(quant_type, _split_planes(blocks, quant_type), rows, cols, table)
    return w.to(dtype)


@dataclass
class GGUFWeight:
    """One GGUF matrix [rows, cols] in planes (see the module docstring and ``_PLANES``):

    * ``d`` fp16 [rows, n_blocks]: each block's (super-block's) scale;
    * ``dm`` fp16 [rows, n_blocks] or None: Q4_1 / Q5_1 ``m``, Q2_K / Q4_K / Q5_K ``dmin``;
    * ``qs`` [rows, n_blocks * n]: the codes' low bits, uint8 (int8 for Q8_0), n = 16
      (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), 32 (Q8_0), 64 (Q2_K, Q3_K), 128 (Q4_K, Q5_K, Q6_K,
      IQ4_XS);
    * ``qh`` or None: the high bits, one unit per 32-bit word of ``qs`` (see ``_HIGH``):
      uint8 [rows, n_blocks * n] with n = 4 (Q5_0, Q5_1), 32 (Q5_K); int16
      [rows, n_blocks * n] with n = 16 (Q3_K), 32 (Q6_K);
    * ``scales`` or None: uint8 [rows, n_blocks * n] with n = 16 (Q2_K), 12 (Q3_K, Q4_K,
      Q5_K), 6 (IQ4_XS: scales_h, scales_l); int8 [rows, n_blocks * 16] for Q6_K;
    * ``table`` float32 [16] or None: IQ4_VALUES, for the IQ4 types;
    * ``splitk_counters`` int32 [rows]: arrival counters of the matmul kernels' split-K
      reduction, all zero between calls (a kernel that uses them leaves them at zero).

    A row's planes hold exactly its blocks' bytes (the high bits rearranged); all planes
    are on one device, contiguous, and ``qs`` rows are multiples of 16 bytes long.
    """

    quant_type: str
    rows: int
    cols: int
    d: torch.Tensor
    qs: torch.Tensor
    splitk_counters: torch.Tensor
    dm: torch.Tensor | None = None
    qh: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    table: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def block_size(self) -> int:
        """Weights per block (32 or 256)."""
        return BLOCK_SIZES[self.quant_type][0]

    def planes(self) -> dict[str, torch.Tensor]:
        """The block planes present, by name."""
        named = {"d": self.d, "dm": self.dm, "qs": self.qs, "qh": self.qh,
                 "scales": self.scales}
        return {k: v for k, v in named.items() if v is not None}

    @property
    def nbytes(self) -> int:
        """Device bytes held: the planes (the matrix's GGUF bytes), the table, the
        counters."""
        tensors = [*self.planes().values(), self.splitk_counters]
        if self.table is not None:
            tensors.append(self.table)
        return sum(t.numel() * t.element_size() for t in tensors)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [rows, cols] matrix, equal to ``dequantize`` of the original blocks."""
        w = _dequantize_planes(self.quant_type, self.planes(), self.rows, self.cols,
                               self.table)
        return w.to(dtype)


def prepare(blocks: torch.Tensor, quant_type: str, rows: int, cols: int) -> GGUFWeight:
    """GGUF blocks (uint8, ``rows`` rows of ``cols`` weights, as ``dequantize`` takes them)
    -> a ``GGUFWeight`` on the blocks' device; ``blocks`` itself is not kept."""
    blocks = _check_geometry(blocks, quant_type, rows, cols)
    planes = _split_planes(blocks, quant_type)
    dev = blocks.device
    return GGUFWeight(
        quant_type=quant_type, rows=rows, cols=cols,
        d=planes["d"], qs=planes["qs"], dm=planes.get("dm"), qh=planes.get("qh"),
        scales=planes.get("scales"),
        table=_iq4_table(dev) if quant_type.startswith("IQ4") else None,
        splitk_counters=torch.zeros(rows, dtype=torch.int32, device=dev))


def embedding(ids: torch.Tensor, weight: GGUFWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the matrix, dequantized: [*ids.shape, cols] of ``dtype``. Only the
    gathered rows are dequantized; no host synchronisation and no shape that depends on
    the ids' values, so it can be captured in a CUDA graph."""
    flat = ids.reshape(-1)
    n = flat.shape[0]
    planes = {name: plane.index_select(0, flat) for name, plane in weight.planes().items()}
    w = _dequantize_planes(weight.quant_type, planes, n, weight.cols, weight.table)
    return w.to(dtype).view(*ids.shape, weight.cols)
