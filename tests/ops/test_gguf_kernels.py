"""GGUF block types: the PyTorch dequantizer against gguf-py (the independent oracle), the
planar GGUFWeight and its embedding gather, and the Triton matmul kernels against their
PyTorch reference (they run under the Triton interpreter on the CPU)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from vllmpy.ops.gguf_quants import (
    _PLANES,
    BLOCK_SIZES,
    GGUFWeight,
    dequantize,
    embedding,
    prepare,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPES = list(BLOCK_SIZES)
# the types gguf-py can quantize; the others get random bytes with sane fp16 scales
QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}


def random_blocks(quant_type: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Realistic blocks uint8 [rows, row_bytes]: gguf-py's quantization of Gaussian
    weights where it has one, else random bytes whose fp16 fields are small positive
    scales (no NaN, no inf)."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[quant_type]
    if quant_type in QUANTIZABLE:
        return gguf.quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32),
                                    qtype)
    per_block, block_bytes = BLOCK_SIZES[quant_type]
    raw = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    for start, end, dtype in _PLANES[quant_type].values():
        if dtype == torch.float16:
            scale = rng.uniform(0.5, 1.5, (rows, cols // per_block, 1)) / 64
            raw[:, :, start:end] = scale.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_block_sizes_match_gguf() -> None:
    for name, size in BLOCK_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == size, name
        planes = _PLANES[name]
        covered = sorted((start, end) for start, end, _ in planes.values())
        assert covered[0][0] == 0 and covered[-1][1] == size[1], name
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), name


@pytest.mark.parametrize("quant_type", TYPES)
def test_dequantize_matches_gguf_py_bit_for_bit(quant_type: str) -> None:
    rows, cols = 6, 512
    raw = random_blocks(quant_type, rows, cols, seed=1)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[quant_type])
    got = dequantize(torch.from_numpy(raw).to(DEVICE), quant_type, cols)
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, cols)
    np.testing.assert_array_equal(got.cpu().numpy().view(np.uint32),
                                  want.reshape(rows, cols).view(np.uint32))
    # then cast once
    assert torch.equal(dequantize(torch.from_numpy(raw).to(DEVICE), quant_type, cols,
                                  torch.bfloat16), got.to(torch.bfloat16))


@pytest.mark.parametrize("quant_type", TYPES)
def test_prepare_and_embedding(quant_type: str) -> None:
    rows, cols = 10, 256
    blocks = torch.from_numpy(random_blocks(quant_type, rows, cols, seed=2)).to(DEVICE)
    dense = dequantize(blocks, quant_type, cols)
    w = prepare(blocks, quant_type, rows, cols)
    assert isinstance(w, GGUFWeight)
    assert (w.quant_type, w.rows, w.cols) == (quant_type, rows, cols)
    assert torch.equal(w.dequantize(), dense)
    assert torch.equal(w.dequantize(torch.float16), dense.to(torch.float16))
    # the planes hold the GGUF bytes and nothing more (but the IQ4 table and counters)
    planes = sum(t.numel() * t.element_size() for t in w.planes().values())
    assert planes == blocks.numel()
    assert w.nbytes == planes + 4 * rows + (64 if w.table is not None else 0)
    assert all(t.device == blocks.device and t.is_contiguous() for t in w.planes().values())
    ids = torch.tensor([3, 0, 9, 3], device=DEVICE)
    assert torch.equal(embedding(ids, w, torch.bfloat16), dense[ids].to(torch.bfloat16))
    grid = torch.tensor([[1, 2], [8, 8]], device=DEVICE)
    assert torch.equal(embedding(grid, w, torch.float32), dense[grid])


def test_geometry_is_checked() -> None:
    blocks = torch.zeros(4, 2 * 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q4_0.*take 144 bytes"):
        prepare(blocks[:, :20], "Q4_0", 4, 64)
    with pytest.raises(ValueError, match="blocks of 256"):
        dequantize(blocks, "Q4_K", 64)
    with pytest.raises(ValueError, match="'Q7_9'.*supported: Q4_0, Q4_1"):
        dequantize(blocks, "Q7_9", 64)
