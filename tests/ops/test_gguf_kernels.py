"""GGUF block types: the PyTorch dequantizer against gguf-py (the independent oracle), the
planar GGUFWeight and its embedding gather, and the Triton matmul kernels against their
PyTorch reference (they run under the Triton interpreter on the CPU)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from vllmpy.ops.gguf_gemm import _gemm, _gemv, gguf_linear, gguf_linear_ref
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


# ---- the matmul kernels -----------------------------------------------------------------

N = 45  # output columns: not a multiple of any tile


def _weight(quant_type: str, rows: int, cols: int, seed: int) -> GGUFWeight:
    blocks = torch.from_numpy(random_blocks(quant_type, rows, cols, seed)).to(DEVICE)
    return prepare(blocks, quant_type, rows, cols)


def _check_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: 1e-4 of the output's magnitude; bf16 / fp16: four ulps of it (the kernels
    keep the weights in fp32 where the reference rounds them to the activation dtype, and
    Triton's interpreter truncates where the GPU rounds)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    if want.dtype == torch.float32:
        atol = 1e-4 * scale
    else:
        atol = 4 * scale * torch.finfo(want.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 512), (2, 256), (3, 256), (40, 512)])
@pytest.mark.parametrize("quant_type", TYPES)
def test_gguf_linear_matches_reference(quant_type: str, m: int, k: int,
                                       dtype: torch.dtype) -> None:
    """Up to GEMV_MAX_M rows (2) run the GEMV, more rows the GEMM; K = 512 splits K
    across programs (the interpreter's device has few multiprocessors), K = 256 does
    not."""
    w = _weight(quant_type, N, k, seed=m)
    g = torch.Generator().manual_seed(k + m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    _check_close(gguf_linear(x, w), gguf_linear_ref(x, w))
    assert not w.splitk_counters.any()  # left at zero for the next call


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q5_1", "Q8_0", "IQ4_NL"])
@pytest.mark.parametrize("m", [1, 20])
def test_partial_last_chunk(quant_type: str, m: int) -> None:
    """32-weight blocks: K = 288 ends a chunk after one block."""
    w = _weight(quant_type, N, 288, seed=3)
    x = torch.randn(m, 288, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    _check_close(gguf_linear(x, w), gguf_linear_ref(x, w))


@pytest.mark.parametrize("quant_type,m", [("Q4_K", 2), ("Q6_K", 3), ("Q3_K", 4), ("Q5_0", 8)])
def test_gemv_kernel_for_several_rows(quant_type: str, m: int) -> None:
    """The GEMV kernel runs up to 8 rows (GEMV_MAX_M can be raised that far); with and
    without split-K."""
    w = _weight(quant_type, N, 512, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    want = gguf_linear_ref(x, w)
    for splits in (1, 2):
        out = torch.empty_like(want)
        _gemv(x, w, None, out, splits)
        _check_close(out, want)


@pytest.mark.parametrize("quant_type", ["Q4_K", "Q6_K", "IQ4_XS"])
def test_gemm_many_rows(quant_type: str) -> None:
    """Past 64 rows the GEMM tile is not transposed and K is not split."""
    w = _weight(quant_type, N, 256, seed=11)
    x = torch.randn(72, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE,
                                                                             torch.bfloat16)
    _check_close(gguf_linear(x, w), gguf_linear_ref(x, w))


@pytest.mark.parametrize("quant_type", ["Q4_K", "Q8_0"])
def test_kernels_without_split_k(quant_type: str) -> None:
    w = _weight(quant_type, N, 512, seed=5)
    for m, run in ((1, _gemv), (24, _gemm)):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        out = torch.empty(m, N, device=DEVICE)
        run(x, w, None, out, 1)
        _check_close(out, gguf_linear_ref(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_out_column_slices_and_bias(m: int, dtype: torch.dtype) -> None:
    """Two shards of different types written side by side into one wide buffer (row
    stride 100, not N), with biases; the activations a row slice of a wider tensor."""
    k = 256
    wq, wv = _weight("Q4_K", N, k, seed=7), _weight("Q6_K", 17, k, seed=8)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k + 30, generator=g).to(DEVICE, dtype)[:, 5:k + 5]
    bq = torch.randn(N, generator=g).to(DEVICE, dtype)
    bv = torch.randn(17, generator=g).to(DEVICE, dtype)
    buf = torch.full((m, 100), 7.0, device=DEVICE, dtype=dtype)
    got_q = gguf_linear(x, wq, bq, out=buf[:, 3:3 + N])
    got_v = gguf_linear(x, wv, bv, out=buf[:, 3 + N:3 + N + 17])
    assert got_q.data_ptr() == buf[:, 3:].data_ptr() and got_v.stride() == buf.stride()
    _check_close(buf[:, 3:3 + N], gguf_linear_ref(x, wq, bq))
    _check_close(buf[:, 3 + N:3 + N + 17], gguf_linear_ref(x, wv, bv))
    untouched = torch.cat([buf[:, :3], buf[:, 3 + N + 17:]], dim=1)
    assert bool((untouched == 7.0).all())


def test_checks() -> None:
    w = _weight("Q4_0", N, 256, seed=9)
    x = torch.randn(2, 256, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        gguf_linear(x[:, :128], w)
    with pytest.raises(ValueError, match="out must be"):
        gguf_linear(x, w, out=torch.empty(2, N, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="bias must be"):
        gguf_linear(x, w, bias=torch.zeros(N + 1, device=DEVICE))
    with pytest.raises(ValueError, match="int8"):
        gguf_linear(x.to(torch.int8), w)
    unknown = GGUFWeight(quant_type="Q1_X", rows=w.rows, cols=w.cols, d=w.d, qs=w.qs,
                         splitk_counters=w.splitk_counters)
    with pytest.raises(ValueError, match="'Q1_X' is not supported; supported: Q4_0"):
        gguf_linear(x, unknown)
    assert gguf_linear(x[:0], w).shape == (0, N)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("m", [1, 4, 64])
def test_cuda_graph_capture(m: int) -> None:
    w = _weight("Q4_K", 4096, 1024, seed=10)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
    gguf_linear(x, w, out=out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gguf_linear(x, w, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _check_close(out, gguf_linear_ref(x, w))
