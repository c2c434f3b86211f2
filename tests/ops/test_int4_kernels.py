"""The W4A16 int4 kernels against their PyTorch references (under Triton's interpreter on
the CPU). The interpreter's ``tl.dot`` misreads bfloat16 tiles, so there the GEMM takes
its bfloat16 tiles to fp32 before the dot (the same products); on a GPU it multiplies
them as they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllmpy.ops.int4_gemm import (
    Int4Packed,
    _launch_gemv,
    _launch_gemv_f16x2,
    dequantize_int4,
    int4_linear,
    int4_linear_ref,
    pack_int4,
    unpack_int4_codes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_weight(n: int, k: int, group: int, symmetric: bool, scale_dtype: torch.dtype,
                seed: int) -> tuple[Int4Packed, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // size, generator=g) * 0.05 + 0.005).to(scale_dtype)
    zeros = None if symmetric else torch.randint(0, 16, (n, k // size), generator=g)
    codes, scales = codes.to(DEVICE), scales.to(DEVICE)
    zeros = zeros.to(DEVICE) if zeros is not None else None
    return pack_int4(codes, scales, zeros, group), codes, scales, zeros


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    if out.dtype == torch.float32:
        tol = 1e-5 * scale
    else:  # the output's rounding and the reference's (the interpreter truncates where
        # the GPU rounds), and for the GEMV its fp32 products of the unrounded weights
        # against the reference's weights rounded to x's dtype: two units in the last
        # place of the largest output
        tol = 2.0**-6 * scale
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=tol)


@pytest.mark.parametrize("n", [40, 41])
def test_pack_round_trip_and_size(n: int) -> None:
    w, codes, scales, zeros = make_weight(n, 256, 64, False, torch.float16, n)
    assert (w.N, w.K, w.group) == (n, 256, 64)
    assert w.qweight.dtype == torch.uint8 and w.qweight.shape == ((n + 1) // 2, 256)
    assert torch.equal(unpack_int4_codes(w), codes.to(torch.uint8))
    assert w.nbytes == (n + 1) // 2 * 256 + n * 4 * 2 + n * 4
    dense = dequantize_int4(w)
    k = torch.arange(256, device=DEVICE)
    expect = (codes.float() - zeros.float()[:, k // 64]) * scales.float()[:, k // 64]
    assert torch.equal(dense, expect)
    assert dequantize_int4(w, torch.bfloat16).dtype == torch.bfloat16


def test_symmetric_and_channel_wise() -> None:
    w, codes, scales, _ = make_weight(9, 96, -1, True, torch.float32, 1)
    assert w.group == 96 and w.zeros is None and w.scales.shape == (9, 1)
    assert torch.equal(dequantize_int4(w), (codes.float() - 8.0) * scales.float())


@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_reference(group: int, symmetric: bool, dtype: torch.dtype) -> None:
    k = 384 if group in (128, -1) else 256
    scale_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    w, _, _, _ = make_weight(41, k, group, symmetric, scale_dtype, group + symmetric)
    bias = torch.randn(41, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    for m in (1, 3, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
        b = bias if m != 3 else None
        out = int4_linear(x, w, b)
        _assert_close(out, int4_linear_ref(x, w, b))
        if m == 1:  # the GEMV against the unrounded weights
            exact = F.linear(x.float(), dequantize_int4(w), b.float()).to(dtype)
            _assert_close(out, exact)


def test_float16_and_leading_dims() -> None:
    w, _, _, _ = make_weight(64, 256, 128, False, torch.float16, 3)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE,
                                                                               torch.float16)
    out = int4_linear(x, w)
    assert out.shape == (2, 5, 64)
    _assert_close(out, int4_linear_ref(x, w))


@pytest.mark.parametrize("split", [1, 2, 3])
def test_gemv_split_k(split: int) -> None:
    w, _, _, _ = make_weight(40, 384, 128, False, torch.float32, 5)
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    bias = torch.randn(40, device=DEVICE)
    _assert_close(_launch_gemv(x, w, bias, split=split), int4_linear_ref(x, w, bias))


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_f16x2_gemv_split_and_dtypes(split: int, dtype: torch.dtype) -> None:
    # the packed GEMV of 16-bit rows: odd N (a last high row past N), a bias, K splits
    w, _, _, _ = make_weight(41, 512, 64, False, torch.bfloat16, 7)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    bias = torch.randn(41, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    out = _launch_gemv_f16x2(x, w, bias, split=split)
    exact = F.linear(x.float(), dequantize_int4(w), bias.float()).to(dtype)
    _assert_close(out, exact)


def test_f16x2_gemv_wide_activation_range() -> None:
    # bfloat16 activations beyond float16's range beside tiny ones: each tile is scaled
    # by a power of two before its float16 products, so nothing overflows or vanishes
    w, _, _, _ = make_weight(24, 256, 32, True, torch.bfloat16, 10)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 256, generator=g)
    x[0, :32] *= 3e5  # the first group's tile
    x[0, 64:96] *= 1e-6
    x = x.to(DEVICE, torch.bfloat16)
    out = _launch_gemv_f16x2(x, w, None, split=1)
    assert torch.isfinite(out.float()).all()
    exact = F.linear(x.float(), dequantize_int4(w)).to(torch.bfloat16)
    _assert_close(out, exact)
    # the tiny group alone still counts: its tile against the same tile in float32
    x_small = torch.zeros_like(x)
    x_small[0, 64:96] = x[0, 64:96]
    out_small = _launch_gemv_f16x2(x_small, w, None, split=1)
    exact_small = F.linear(x_small.float(), dequantize_int4(w)).to(torch.bfloat16)
    assert exact_small.float().abs().max() > 0
    _assert_close(out_small, exact_small)


def test_refusals() -> None:
    codes = torch.randint(0, 16, (8, 64))
    scales = torch.ones(8, 2)
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(codes + 1, scales, None, 32)
    with pytest.raises(ValueError, match="must divide K"):
        pack_int4(codes, torch.ones(8, 1), None, 48)
    with pytest.raises(ValueError, match="power of two"):
        pack_int4(torch.randint(0, 16, (8, 96)), torch.ones(8, 2), None, 48)
    with pytest.raises(ValueError, match="scales must be"):
        pack_int4(codes, torch.ones(8, 3), None, 32)
    with pytest.raises(ValueError, match="zeros must lie"):
        pack_int4(codes, scales, torch.full((8, 2), 16), 32)
    w = pack_int4(codes.to(DEVICE), scales.to(DEVICE), None, 32)
    with pytest.raises(ValueError, match="needs x"):
        int4_linear(torch.randn(1, 32, device=DEVICE), w)
