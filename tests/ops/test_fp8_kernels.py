"""The fp8 W8A8 kernels against their PyTorch references (under Triton's interpreter on
the CPU). The interpreter rounds some fp32 -> e4m3 conversions wrongly, so on the CPU the
kernels encode e4m3 bit-wise (``_e4m3_bits``); the first test holds that encoder to
torch's rounding, and on a GPU the same tests check the hardware conversion. Tests of
``torch._scaled_mm`` need a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from vllmpy.ops.fp8_gemm import (
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    _launch_block_gemv,
    _launch_channel_gemv,
    _to_fp8,
    dequantize_fp8_block,
    fp8_block_linear,
    fp8_block_linear_ref,
    fp8_scaled_linear,
    fp8_scaled_linear_ref,
    gemv_split,
    native_fp8,
    quant_fp8_per_group,
    quant_fp8_per_group_ref,
    quant_fp8_per_tensor,
    quant_fp8_per_tensor_ref,
    quant_fp8_per_token,
    quant_fp8_per_token_ref,
    scaled_linear_path,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_SCALED_MM = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, _to_fp8(v, NATIVE), mask=offs < n)


def test_e4m3_encoding_rounds_as_torch() -> None:
    # every e4m3 value, the midpoints between neighbours and the fp32 values either side
    # of them, tiny and saturating magnitudes, and random values
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([values, mids, torch.nextafter(mids, torch.tensor(1e9)),
                   torch.nextafter(mids, torch.tensor(-1e9)),
                   torch.tensor([449.0, 464.0, 465.0, 1e6, -1e6, 2.0**-10, 2.0**-11]),
                   torch.randn(8192, generator=g) * 40, torch.randn(2048, generator=g) * 1e-3])
    x = torch.cat([x, -x]).to(DEVICE)
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=DEVICE)
    _encode_kernel[(triton.cdiv(x.numel(), 4096),)](x, out, x.numel(),
                                                      NATIVE=native_fp8(x.device), BLOCK=4096)
    ref = x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert torch.equal(codes(out), codes(ref))


def _activation(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
    x[0, :] = 0.0  # an all-zero row gets the floor scale and zero codes
    return x.to(DEVICE, dtype)


def _check_round_trip(x: torch.Tensor, xq: torch.Tensor, scale: torch.Tensor) -> None:
    # dequantized within half an e4m3 step: 2^-4 of the value for normals, 2^-10 of the
    # scale below 2^-6 (the subnormal spacing is 2^-9)
    xf = x.float()
    err = (xq.float() * scale - xf).abs()
    assert bool((err <= xf.abs() * 2.0**-4 + scale * 2.0**-10 + 1e-30).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_quantization(dtype: torch.dtype) -> None:
    x = _activation(7, 300, dtype, 1)
    xq, scale = quant_fp8_per_token(x)
    rq, rs = quant_fp8_per_token_ref(x)
    assert xq.dtype == FP8_DTYPE and scale.shape == (7, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, rs) and torch.equal(codes(xq), codes(rq))
    amax = x.float().abs().amax(dim=1, keepdim=True)
    assert torch.equal(scale[1:], amax[1:] / FP8_MAX)
    assert scale[0].item() == pytest.approx(AMAX_FLOOR / FP8_MAX) and not codes(xq[0]).any()
    _check_round_trip(x, xq, scale)


@pytest.mark.parametrize("k,group", [(384, 128), (320, 128), (256, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_group_quantization(k: int, group: int, dtype: torch.dtype) -> None:
    wide = _activation(5, k + 64, dtype, k + group)
    x = wide[:, :k]  # rows strided past K
    xq, scale = quant_fp8_per_group(x, group)
    rq, rs = quant_fp8_per_group_ref(x, group)
    n_groups = triton.cdiv(k, group)
    assert scale.shape == (5, n_groups) and xq.shape == (5, k)
    assert torch.equal(scale, rs) and torch.equal(codes(xq), codes(rq))
    for gi in range(n_groups):
        amax = x[1:, gi * group:(gi + 1) * group].float().abs().amax(dim=1)
        assert torch.equal(scale[1:, gi], amax / FP8_MAX)
    _check_round_trip(x, xq, scale.repeat_interleave(group, 1)[:, :k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_tensor_quantization(dtype: torch.dtype) -> None:
    x = _activation(9, 200, dtype, 2)
    xq, scale = quant_fp8_per_tensor(x)
    rq, rs = quant_fp8_per_tensor_ref(x)
    assert scale.shape == (1,) and torch.equal(scale, rs)
    assert torch.equal(scale, x.float().abs().amax().reshape(1) / FP8_MAX)
    assert torch.equal(codes(xq), codes(rq))
    _check_round_trip(x, xq, scale)
    # static: the given scale, saturating what lies past 448 * scale
    static = torch.tensor([0.05], device=DEVICE)
    xq, out_scale = quant_fp8_per_tensor(x, static)
    rq, _ = quant_fp8_per_tensor_ref(x, static)
    assert out_scale is static and torch.equal(codes(xq), codes(rq))
    assert xq.float().abs().max().item() == FP8_MAX


def _block_weight(n: int, k: int, block: tuple[int, int], seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    grid = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    scale = torch.rand(grid, generator=g) * 0.02 + 1e-3
    return w.to(DEVICE), scale.to(DEVICE)


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    if out.dtype == torch.float32:  # the same quantized operands: fp32 sums in another order
        tol = 1e-5 * scale
    else:  # one rounding to bfloat16 (the interpreter truncates where the GPU rounds)
        tol = 2.0**-7 * scale
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=tol)


@pytest.mark.parametrize("m", [1, 3, 33])
@pytest.mark.parametrize("n,k", [(40, 256), (200, 320)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_linear_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    w, ws = _block_weight(n, k, (128, 128), n + k)
    x = _activation(m, k, dtype, m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    for b in (None, bias):
        _assert_close(fp8_block_linear(x, w, ws, b), fp8_block_linear_ref(x, w, ws, b))


@pytest.mark.skipif(not HAS_SCALED_MM, reason="needs a CUDA GPU with fp8")
@pytest.mark.parametrize("m", [17, 33, 256])
def test_block_linear_cublas_path_matches_reference(m: int) -> None:
    # more than 16 bfloat16 rows of a 128 x 128-block weight, N and K multiples of 128:
    # cuBLAS's block-scaled GEMM where the device runs it (checked once, at first use)
    from vllmpy.ops.fp8_gemm import block_scaled_mm

    mode = block_scaled_mm(torch.device(DEVICE))
    print(f"cuBLAS block-scaled fp8 GEMM on this device: {mode}")
    w, ws = _block_weight(256, 384, (128, 128), m)
    x = _activation(m, 384, torch.bfloat16, m)
    bias = torch.randn(256, generator=torch.Generator().manual_seed(3)).to(DEVICE,
                                                                           torch.bfloat16)
    for b in (None, bias):
        _assert_close(fp8_block_linear(x, w, ws, b), fp8_block_linear_ref(x, w, ws, b))


def test_block_linear_other_blocks_and_leading_dims() -> None:
    w, ws = _block_weight(72, 192, (64, 64), 5)
    x = _activation(6, 192, torch.bfloat16, 6).reshape(2, 3, 192)
    out = fp8_block_linear(x, w, ws, block=(64, 64))
    assert out.shape == (2, 3, 72)
    _assert_close(out, fp8_block_linear_ref(x, w, ws, block=(64, 64)))
    one = x[:1, :1]
    _assert_close(fp8_block_linear(one, w, ws, block=(64, 64)),
                  fp8_block_linear_ref(one, w, ws, block=(64, 64)))


@pytest.mark.parametrize("split", [1, 2, 3])
def test_block_gemv_split_k(split: int) -> None:
    w, ws = _block_weight(40, 384, (128, 128), 7)
    x = _activation(2, 384, torch.float32, 8)[1:]
    bias = torch.randn(40, device=DEVICE)
    out = _launch_block_gemv(x, w, ws, bias, (128, 128), split=split)
    _assert_close(out, fp8_block_linear_ref(x, w, ws, bias))


def test_block_dequantization_reference() -> None:
    w, ws = _block_weight(130, 140, (128, 128), 9)
    dense = dequantize_fp8_block(w, ws)
    assert torch.equal(dense[129, 139], w[129, 139].float() * ws[1, 1])
    assert torch.equal(dense[0, 127], w[0, 127].float() * ws[0, 0])
    assert torch.equal(dense[128, 0], w[128, 0].float() * ws[1, 0])


def test_gemv_split_rule() -> None:
    assert gemv_split(512, 8, 132) == 1
    assert gemv_split(64, 8, 132) == 3
    assert gemv_split(4, 2, 132) == 2


def _channel_weight(n: int, k: int, per_channel: bool, seed: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale = torch.rand(n, 1, generator=g) * 0.02 + 1e-3 if per_channel else torch.tensor(0.01)
    return w.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("m", [1, 3, 33])
@pytest.mark.parametrize("activation", ["per_token", "per_tensor", "static"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_scaled_linear_matches_reference(m: int, activation: str, per_channel: bool) -> None:
    n, k = 48, 256
    w, ws = _channel_weight(n, k, per_channel, m)
    x = _activation(m, k, torch.bfloat16, m + 10)
    input_scale = torch.tensor([0.02], device=DEVICE) if activation == "static" else None
    dynamic = "per_tensor" if activation == "per_tensor" else "per_token"
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(DEVICE, x.dtype)
    for b in (None, bias):
        out = fp8_scaled_linear(x, w, ws, input_scale, b, dynamic=dynamic)
        ref = fp8_scaled_linear_ref(x, w, ws, input_scale, b, dynamic=dynamic)
        _assert_close(out, ref)


@pytest.mark.parametrize("m", [1, 17])
def test_scaled_linear_fp32_odd_shapes(m: int) -> None:
    w, ws = _channel_weight(41, 200, True, 11)  # N, K not multiples of 16
    x = _activation(m, 200, torch.float32, 12)
    for dynamic in ("per_token", "per_tensor"):
        _assert_close(fp8_scaled_linear(x, w, ws, dynamic=dynamic),
                      fp8_scaled_linear_ref(x, w, ws, dynamic=dynamic))


@pytest.mark.parametrize("split", [1, 2])
def test_channel_gemv_split_k(split: int) -> None:
    w, ws = _channel_weight(24, 384, True, 13)
    x = _activation(2, 384, torch.float32, 14)[1:]
    out = _launch_channel_gemv(x, None, w, ws.reshape(-1), None, split=split)
    _assert_close(out, fp8_scaled_linear_ref(x, w, ws))


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the paths taken without a GPU")
def test_scaled_linear_paths_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert scaled_linear_path(1, 4096, 4096, torch.bfloat16, cpu, rowwise=True) == "gemv"
    assert scaled_linear_path(64, 4096, 4096, torch.bfloat16, cpu, rowwise=True) == "gemm"


@pytest.mark.skipif(not HAS_SCALED_MM,
                    reason="torch._scaled_mm needs a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("activation", ["per_token", "per_tensor", "static"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_scaled_mm_path_matches_reference(activation: str, per_channel: bool) -> None:
    m, n, k = 64, 256, 512
    w, ws = _channel_weight(n, k, per_channel, 15)
    x = _activation(m, k, torch.bfloat16, 16)
    input_scale = torch.tensor([0.02], device=DEVICE) if activation == "static" else None
    dynamic = "per_tensor" if activation == "per_tensor" else "per_token"
    rowwise = activation == "per_token" or per_channel
    assert scaled_linear_path(m, n, k, x.dtype, x.device, rowwise) == "scaled_mm"
    bias = torch.randn(n, device=DEVICE, dtype=x.dtype)
    out = fp8_scaled_linear(x, w, ws, input_scale, bias, dynamic=dynamic)
    _assert_close(out, fp8_scaled_linear_ref(x, w, ws, input_scale, bias, dynamic=dynamic))


def test_refusals() -> None:
    w, ws = _block_weight(40, 256, (128, 128), 17)
    x = torch.randn(2, 256, device=DEVICE)
    with pytest.raises(ValueError, match="float8"):
        fp8_block_linear(x, w.float(), ws)
    with pytest.raises(ValueError, match="weight_scale must be"):
        fp8_block_linear(x, w, ws[:, :1])
    with pytest.raises(ValueError, match="block is"):
        fp8_block_linear(x, w, ws, block=(128, 100))
    with pytest.raises(ValueError, match="needs x"):
        fp8_block_linear(torch.randn(2, 128, device=DEVICE), w, ws)
    with pytest.raises(ValueError, match="dynamic must be"):
        fp8_scaled_linear(x, w, torch.tensor(1.0, device=DEVICE), dynamic="per_group")
    with pytest.raises(ValueError, match="weight_scale must be"):
        fp8_scaled_linear(x, w, torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="input_scale"):
        fp8_scaled_linear(x, w, torch.tensor(1.0, device=DEVICE), torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        quant_fp8_per_group(x, 96)
