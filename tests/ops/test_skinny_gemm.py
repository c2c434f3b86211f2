"""The skinny GEMM kernel and its fused prologues against their PyTorch references (they run
under the Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllmpy.ops.fused import rms_norm, silu_and_mul
from vllmpy.ops.paged_attention import num_multiprocessors
from vllmpy.ops.skinny_gemm import (
    FOLD_MAX_CHUNKS,
    FOLD_MAX_PROGRAMS_PER_SM,
    MAX_ROWS,
    NORM_WIDE_K,
    PLAIN,
    RMS_NORM,
    SILU_MUL,
    WHOLE_SHARE_ELEMS,
    WHOLE_SHARE_WAVES,
    _launch,
    folds_norm,
    norm_launch,
    rms_norm_gemm,
    rms_norm_gemm_ref,
    silu_mul_gemm,
    silu_mul_gemm_ref,
    skinny_gemm,
    whole_share_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (3, 64, 512), (8, 33, 1030), (5, 7, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear_fp32(m: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    torch.testing.assert_close(skinny_gemm(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_bf16_rounds_once_from_fp32() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(48, 256, generator=g).to(DEVICE, torch.bfloat16)
    out = skinny_gemm(x, w)
    assert out.dtype == torch.bfloat16
    exact = F.linear(x.float(), w.float())
    # fp32 accumulation rounded once: within one bf16 ulp of the fp32 product (the
    # interpreter truncates where the GPU rounds to nearest)
    torch.testing.assert_close(out.float(), exact, rtol=2**-7, atol=1e-3)


def test_refusals() -> None:
    x = torch.randn(MAX_ROWS + 1, 16)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        skinny_gemm(x, torch.randn(4, 16))
    with pytest.raises(ValueError, match="needs x \\[M, K\\]"):
        skinny_gemm(torch.randn(16), torch.randn(4, 16))
    with pytest.raises(ValueError, match="weight \\[N, 16\\]"):
        skinny_gemm(torch.randn(1, 16), torch.randn(4, 15))
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        skinny_gemm(torch.randn(1, 16), torch.randn(16, 4).t())
    with pytest.raises(ValueError, match="bias must be"):
        skinny_gemm(torch.randn(1, 16), torch.randn(4, 16), torch.randn(5))


@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (3, 64, 512), (8, 24, 1030), (2, 300, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_rms_norm_gemm_matches_reference_fp32(m: int, n: int, k: int, with_residual: bool,
                                              bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 100 + n + with_residual)
    x = (3 * torch.randn(m, k, generator=g)).to(DEVICE)
    res = torch.randn(m, k, generator=g).to(DEVICE) if with_residual else None
    nw = torch.rand(k, generator=g).to(DEVICE) + 0.5
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    out, total = rms_norm_gemm(x, res, nw, 1e-6, w, b)
    ref_out, ref_total = rms_norm_gemm_ref(x, res, nw, 1e-6, w, b)
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-4)
    if res is None:
        assert total is x  # no sum to make: the input is the residual


def _bf16_norm_inputs(k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(DEVICE, torch.bfloat16)
    res = torch.randn(1, k, generator=g).to(DEVICE, torch.bfloat16)
    nw = (torch.rand(k, generator=g) + 0.5).to(DEVICE, torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(DEVICE, torch.bfloat16)
    return x, res, nw, w


def test_rms_norm_gemm_bf16_rounds_as_the_unfused_kernels_over_many_chunks() -> None:
    # 8 chunks and a grid of more than one wave: the row's norm comes first and the
    # normalized chunks round where rms_norm rounds, so the product is the two launches'
    # up to the order of the fp32 sums
    n = 8 * (FOLD_MAX_PROGRAMS_PER_SM * num_multiprocessors(torch.device(DEVICE)) + 1)
    assert not folds_norm(1, n, 512, 8, 64, num_multiprocessors(torch.device(DEVICE)))
    x, res, nw, w = _bf16_norm_inputs(512, n, 1)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=DEVICE)
    total = torch.empty_like(x)
    _launch(x, res, nw, total, w, None, out, RMS_NORM, 1e-6, 8, 64, 4, 3)
    normed, ref_total = rms_norm(x, nw, 1e-6, res)
    assert torch.equal(total, ref_total)
    ref = skinny_gemm(normed, w)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-2)
    exact = F.linear(normed.float(), w.float())
    torch.testing.assert_close(out.float(), exact, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("chunks", [1, 2, 8])
def test_rms_norm_gemm_bf16_folds_the_norm_over_few_chunks_or_one_wave(chunks: int) -> None:
    # At most FOLD_MAX_CHUNKS chunks, or one row over a grid that runs at once (12
    # programs): the 1 / rms scales the fp32 sums at the end, and the normalized
    # activations are never rounded, so the result is the fp32 product of the unrounded
    # normalization, rounded once (to nearest on the GPU; Triton's interpreter truncates,
    # a full bfloat16 step of 2^-7).
    k, n = 512, 96
    sms = num_multiprocessors(torch.device(DEVICE))
    if chunks > FOLD_MAX_CHUNKS:  # it folds for its grid, which runs at once
        assert n // 8 <= FOLD_MAX_PROGRAMS_PER_SM * sms
    assert folds_norm(1, n, k, 8, k // chunks, sms)
    x, res, nw, w = _bf16_norm_inputs(k, n, 2 + chunks)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=DEVICE)
    total = torch.empty_like(x)
    _launch(x, res, nw, total, w, None, out, RMS_NORM, 1e-6, 8, k // chunks, 4,
            1 if chunks == 1 else 3)
    normed, ref_total = rms_norm(x, nw, 1e-6, res)
    assert torch.equal(total, ref_total)
    t = ref_total.float()
    unrounded = nw.float() * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)
    exact = F.linear(unrounded, w.float())
    terms = F.linear(unrounded.abs(), w.float().abs())  # sum of |each term|
    assert ((out.float() - exact).abs() <= 2**-7 * exact.abs() + 1e-5 * terms).all()
    # and on the whole it is closer to that product than the unfused launches are
    unfused = skinny_gemm(normed, w).float()
    assert (out.float() - exact).abs().mean() < (unfused - exact).abs().mean()


@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (4, 64, 512), (8, 9, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_gemm_matches_reference_fp32(m: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 10 + n)
    x = (2 * torch.randn(m, 2 * k, generator=g)).to(DEVICE)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    torch.testing.assert_close(silu_mul_gemm(x, w, b), silu_mul_gemm_ref(x, w, b),
                               rtol=1e-5, atol=1e-4)


def test_silu_mul_gemm_bf16_equals_the_unfused_kernels() -> None:
    g = torch.Generator().manual_seed(2)
    x = (2 * torch.randn(1, 2 * 384, generator=g)).to(DEVICE, torch.bfloat16)
    w = torch.randn(80, 384, generator=g).to(DEVICE, torch.bfloat16)
    act = silu_and_mul(x)
    # the prologue rounds as the SiLU kernel does, and the sums run in the same order
    assert torch.equal(silu_mul_gemm(x, w), skinny_gemm(act, w))
    exact = F.linear(act.float(), w.float())
    torch.testing.assert_close(silu_mul_gemm(x, w).float(), exact, rtol=2**-7, atol=1e-2)


def test_fused_refusals() -> None:
    x = torch.randn(1, 16)
    w = torch.randn(4, 16)
    with pytest.raises(ValueError, match="norm_weight must be a contiguous \\[16\\]"):
        rms_norm_gemm(x, None, torch.ones(15), 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight must be .* of torch.float32"):
        rms_norm_gemm(x, None, torch.ones(16, dtype=torch.bfloat16), 1e-6, w)
    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm_gemm(x, torch.randn(1, 8), torch.ones(16), 1e-6, w)
    with pytest.raises(ValueError, match="x \\[M, 2 \\* K\\]"):
        silu_mul_gemm(torch.randn(1, 15), w)
    with pytest.raises(ValueError, match="weight \\[N, 8\\]"):
        silu_mul_gemm(x, w)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        silu_mul_gemm(torch.randn(MAX_ROWS + 1, 32), w)


@pytest.mark.parametrize("with_residual", [False, True])
def test_layers_route_one_streamed_row_through_the_fused_kernels(monkeypatch, with_residual):
    # the layer helpers pick the fused kernels for a streamed row (on the GPU: one CUDA
    # row) and the separate layers otherwise; both ways give the same values
    from vllmpy.layers.linear import Linear, PackedLinear, rms_norm_linear
    from vllmpy.layers.mlp import GatedMLP
    from vllmpy.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = torch.rand(48, generator=g) + 0.5
    qkv = PackedLinear(48, {"q": 32, "k": 16, "v": 16}, bias=True)
    qkv.weight.data = torch.randn(64, 48, generator=g)
    qkv.bias.data = torch.randn(64, generator=g)
    mlp = GatedMLP(48, 40)
    mlp.gate_up_proj.weight.data = torch.randn(80, 48, generator=g)
    mlp.down_proj.weight.data = torch.randn(48, 40, generator=g)
    from vllmpy.ops import skinny_gemm

    for module in (norm, qkv, mlp):
        module.to(DEVICE)
    for linear in (qkv, mlp.gate_up_proj, mlp.down_proj):
        linear.on_cuda, linear.method.skinny = True, skinny_gemm  # as binding to CUDA does
    # as on CUDA, the dense weights stay as they are (a CPU float32 layer would pack its
    # weight for oneDNN at the first product)
    monkeypatch.setattr("vllmpy.layers.quantization.dense.cpu_packs", lambda w: False)
    x = torch.randn(1, 48, generator=g).to(DEVICE)
    res = torch.randn(1, 48, generator=g).to(DEVICE) if with_residual else None
    monkeypatch.setattr(Linear, "streams_one_row", lambda self, t: False)
    out, total = rms_norm_linear(norm, qkv, x, res)
    down = mlp(x)
    calls = []
    monkeypatch.setattr(Linear, "streams_one_row", lambda self, t: calls.append(1) or True)
    fused_out, fused_total = rms_norm_linear(norm, qkv, x, res)
    fused_down = mlp(x)
    assert len(calls) >= 3  # the norm + qkv, the gate_up and the down projection asked
    torch.testing.assert_close(fused_total, total, rtol=0, atol=0)
    torch.testing.assert_close(fused_out, out, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused_down, down, rtol=1e-5, atol=1e-4)


def test_whole_share_rows_for_the_benchmark_models() -> None:
    # H200 (132 multiprocessors): Qwen3-0.6B's qkv, o and down projections take one wave
    # of whole shares; its gate_up (too many programs) and all of Qwen3-8B's stream chunks
    assert whole_share_rows(4096, 1024, 132) == 16  # qkv: 256 programs
    assert whole_share_rows(1024, 2048, 132) == 8  # o: 128
    assert whole_share_rows(1024, 3072, 132) == 4  # down (K padded to 4096): 256
    assert whole_share_rows(6144, 1024, 132) is None  # gate_up: 384 > 2 x 132
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        assert whole_share_rows(n, k, 132) is None
    assert whole_share_rows(8, 1 << 20, 132) is None  # one row is more than a share


@pytest.mark.parametrize("n,k,sms", [(4096, 1024, 132), (1000, 3000, 132), (40, 70, 4),
                                     (7, 9, 1), (300, 64, 2)])
def test_whole_share_rows_fit_a_share_and_the_grid(n: int, k: int, sms: int) -> None:
    rows = whole_share_rows(n, k, sms)
    assert rows is not None
    k_pad = 1 << (k - 1).bit_length()
    assert rows & (rows - 1) == 0 and rows * k_pad <= WHOLE_SHARE_ELEMS
    programs = -(-n // rows)
    assert programs <= WHOLE_SHARE_WAVES * sms
    # the fewest rows: half as many would need more programs than multiprocessors
    assert rows == 1 or -(-n // (rows // 2)) > sms


# (rows, chunk, warps, stages): a streamed launch (several chunks, pipelined), one of two
# chunks (a norm folded into the sums) and a whole-share one (one chunk past K, masked)
LAUNCHES = {"chunked": (4, 64, 4, 3), "two": (4, 128, 4, 3), "whole": (8, 256, 8, 1)}


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
@pytest.mark.parametrize("prologue", [PLAIN, RMS_NORM, SILU_MUL])
@pytest.mark.parametrize("m", [1, 2])  # one row of several chunks keeps per-thread sums
def test_both_launch_kinds_match_the_reference(launch: str, prologue: int, m: int) -> None:
    n, k = 21, 200  # K not a multiple of the chunk: the last chunk is masked
    g = torch.Generator().manual_seed(prologue * 10 + len(launch) + 100 * m)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE)
    out = torch.empty(m, n, device=DEVICE)
    if prologue == SILU_MUL:
        x = torch.randn(m, 2 * k, generator=g).to(DEVICE)
        _launch(x, None, None, None, w, b, out, prologue, 0.0, *LAUNCHES[launch])
        ref = silu_mul_gemm_ref(x, w, b)
    elif prologue == RMS_NORM:
        x = torch.randn(m, k, generator=g).to(DEVICE)
        res = torch.randn(m, k, generator=g).to(DEVICE)
        nw = torch.rand(k, generator=g).to(DEVICE) + 0.5
        total = torch.empty_like(x)
        _launch(x, res, nw, total, w, b, out, prologue, 1e-6, *LAUNCHES[launch])
        ref, ref_total = rms_norm_gemm_ref(x, res, nw, 1e-6, w, b)
        torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    else:
        x = torch.randn(m, k, generator=g).to(DEVICE)
        _launch(x, None, None, None, w, b, out, prologue, 0.0, *LAUNCHES[launch])
        ref = F.linear(x, w, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_norm_launch_for_the_benchmark_models() -> None:
    # H200 (132 multiprocessors), one row: Qwen3-8B's qkv runs in one wave of 1024-wide
    # chunks and folds its norm; its gate_up streams 2048-wide chunks, two of them, and
    # folds too; Qwen3-0.6B's gate_up and every launch of more rows keep 512-wide chunks
    assert norm_launch(1, 6144, 4096, 132) == (8, 1024, 4)
    assert folds_norm(1, 6144, 4096, 8, 1024, 132)
    assert norm_launch(1, 24576, 4096, 132) == (8, 2048, 8)
    assert folds_norm(1, 24576, 4096, 8, 2048, 132)
    assert norm_launch(1, 6144, 1024, 132) == (8, 512, 4)
    assert norm_launch(2, 6144, 4096, 132) == (8, 512, 4)
    assert norm_launch(1, 24576, 4096 - 1, 132) == (8, 512, 4)


def test_folds_norm_for_the_benchmark_models() -> None:
    # H200: 132 multiprocessors; 8 rows, 512-wide chunks (the tiles of a norm launch of
    # more rows, or of shorter rows; one-row launches of long rows: norm_launch above)
    assert folds_norm(1, 6144, 1024, 8, 1024, 132)  # Qwen3-0.6B qkv: one chunk
    assert folds_norm(1, 6144, 1024, 8, 512, 132)  # Qwen3-0.6B gate_up: two chunks
    assert folds_norm(1, 6144, 4096, 8, 512, 132)  # Qwen3-8B qkv: 768 programs, one wave
    assert not folds_norm(1, 24576, 4096, 8, 512, 132)  # Qwen3-8B gate_up: 3,072 programs
    assert not folds_norm(2, 6144, 4096, 8, 512, 132)  # more rows: the prologue


@pytest.mark.parametrize("prologue,grid", [(RMS_NORM, "one wave"), (RMS_NORM, "more"),
                                           (SILU_MUL, "more"), (PLAIN, "more")])
def test_one_row_default_launches_of_long_rows_match_the_reference(prologue: int,
                                                                     grid: str) -> None:
    # K = 4,096, one row, too many weight rows for whole shares: the streamed launches
    # Qwen3-8B's decode takes. Per-thread sums over 1024-wide chunks on a one-wave grid
    # (qkv), over 2048-wide folded chunks on a larger one (gate_up), over 2048-wide SiLU
    # chunks (down) and over 1024-wide plain chunks (o)
    k = NORM_WIDE_K
    sms = num_multiprocessors(torch.device(DEVICE))
    n = 8 * (WHOLE_SHARE_WAVES * sms + 1)
    if grid == "more":
        n = max(n, 8 * (FOLD_MAX_PROGRAMS_PER_SM * sms + 1))
    assert whole_share_rows(n, k, sms) is None
    if prologue == RMS_NORM:
        assert norm_launch(1, n, k, sms) == ((8, 1024, 4) if grid == "one wave"
                                             else (8, 2048, 8))
    g = torch.Generator().manual_seed(prologue * 100 + n)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    if prologue == RMS_NORM:
        x = torch.randn(1, k, generator=g).to(DEVICE)
        res = torch.randn(1, k, generator=g).to(DEVICE)
        nw = torch.rand(k, generator=g).to(DEVICE) + 0.5
        out, total = rms_norm_gemm(x, res, nw, 1e-6, w)
        ref, ref_total = rms_norm_gemm_ref(x, res, nw, 1e-6, w)
        torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    elif prologue == SILU_MUL:
        x = torch.randn(1, 2 * k, generator=g).to(DEVICE)
        out, ref = silu_mul_gemm(x, w), silu_mul_gemm_ref(x, w)
    else:
        x = torch.randn(1, k, generator=g).to(DEVICE)
        out, ref = skinny_gemm(x, w), F.linear(x, w)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)


# ---- fp8 weights with their scales ------------------------------------------------------

def _fp8_weight(n: int, k: int, block: tuple[int, int] | None, g: torch.Generator):
    """(codes, WeightScale, the dequantized float32 weight) of a random [n, k] matrix,
    quantized by the FP8 method's own quantizers (the layout checkpoints store)."""
    from vllmpy.layers.quantization.fp8 import (
        dequantize_block,
        quantize_per_block,
        quantize_per_tensor,
    )
    from vllmpy.ops.skinny_gemm import WeightScale

    w = torch.randn(n, k, generator=g)
    if block is not None:
        codes, s = quantize_per_block(w, block)
        return (codes.to(DEVICE), WeightScale(s.to(DEVICE), block),
                dequantize_block(codes, s, block, torch.float32).to(DEVICE))
    rows = []
    scales = []
    for part in w.split([n // 2, n - n // 2]):  # two shards, each its own tensor scale
        codes, s = quantize_per_tensor(part)
        rows.append(codes)
        scales.append(s.expand(part.shape[0]))
    codes, s = torch.cat(rows), torch.cat(scales).reshape(n, 1).contiguous()
    return codes.to(DEVICE), WeightScale(s.to(DEVICE)), (codes.float() * s).to(DEVICE)


FP8_SCALES = {"rows": None, "block128": (128, 128), "block16x32": (16, 32)}


@pytest.mark.parametrize("scales", sorted(FP8_SCALES))
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
@pytest.mark.parametrize("prologue", [PLAIN, RMS_NORM, SILU_MUL])
def test_fp8_weights_match_their_dequantized_product(scales: str, launch: str,
                                                     prologue: int) -> None:
    # the codes widened, times the activation scaled per block (or the row's sum scaled):
    # the float32 product with the dequantized weight, up to the order of the sums
    block = FP8_SCALES[scales]
    n, k = 150, 300  # N and K not multiples of the blocks: partial tiles at both edges
    g = torch.Generator().manual_seed(len(scales) * 7 + prologue + 3 * len(launch))
    codes, scale, dense = _fp8_weight(n, k, block, g)
    b = torch.randn(n, generator=g).to(DEVICE)
    out = torch.empty(1, n, device=DEVICE)
    if prologue == SILU_MUL:
        x = torch.randn(1, 2 * k, generator=g).to(DEVICE)
        _launch(x, None, None, None, codes, b, out, prologue, 0.0, *LAUNCHES[launch],
                scale=scale)
        ref = silu_mul_gemm_ref(x, dense, b)
    elif prologue == RMS_NORM:
        x = torch.randn(1, k, generator=g).to(DEVICE)
        res = torch.randn(1, k, generator=g).to(DEVICE)
        nw = torch.rand(k, generator=g).to(DEVICE) + 0.5
        total = torch.empty_like(x)
        _launch(x, res, nw, total, codes, b, out, prologue, 1e-6, *LAUNCHES[launch],
                scale=scale)
        ref, _ = rms_norm_gemm_ref(x, res, nw, 1e-6, dense, b)
    else:
        x = torch.randn(1, k, generator=g).to(DEVICE)
        _launch(x, None, None, None, codes, b, out, prologue, 0.0, *LAUNCHES[launch],
                scale=scale)
        ref = F.linear(x, dense, b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scales", sorted(FP8_SCALES))
def test_fp8_public_functions_in_bf16(scales: str) -> None:
    # the entry points the FP8 method calls, on bfloat16 rows of a few sizes
    block = FP8_SCALES[scales]
    g = torch.Generator().manual_seed(11)
    codes, scale, dense = _fp8_weight(96, 256, block, g)
    for m in (1, 3):
        x = torch.randn(m, 256, generator=g).to(DEVICE, torch.bfloat16)
        exact = F.linear(x.float(), dense)
        torch.testing.assert_close(skinny_gemm(x, codes, scale=scale).float(), exact,
                                   rtol=2**-7, atol=2e-2)
        nw = (torch.rand(256, generator=g) + 0.5).to(DEVICE, torch.bfloat16)
        out, total = rms_norm_gemm(x, None, nw, 1e-6, codes, scale=scale)
        ref, _ = rms_norm_gemm_ref(x.float(), None, nw.float(), 1e-6, dense)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=5e-2)
        xx = torch.randn(m, 512, generator=g).to(DEVICE, torch.bfloat16)
        torch.testing.assert_close(silu_mul_gemm(xx, codes, scale=scale).float(),
                                   silu_mul_gemm_ref(xx.float(), dense), rtol=2e-2, atol=5e-2)


def test_fp8_scale_refusals() -> None:
    from vllmpy.ops.skinny_gemm import WeightScale

    x = torch.randn(1, 64)
    codes = torch.randn(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8 weight needs its weight_scale"):
        skinny_gemm(x, codes)
    with pytest.raises(ValueError, match="weight_scale is for fp8 weights"):
        skinny_gemm(x, torch.randn(32, 64), scale=WeightScale(torch.ones(32)))
    with pytest.raises(ValueError, match=r"per-row weight_scale must be a contiguous float32 \[32\]"):
        skinny_gemm(x, codes, scale=WeightScale(torch.ones(16)))
    with pytest.raises(ValueError, match=r"block weight_scale must be a float32 \[1, 1\]"):
        skinny_gemm(x, codes, scale=WeightScale(torch.ones(2, 2), (128, 128)))


@pytest.mark.parametrize("scheme", ["block", "tensor"])
def test_fp8_layers_stream_one_row_through_the_fused_kernels(scheme: str) -> None:
    # an FP8 method bound to the streaming kernel (as binding to CUDA does) takes a one-row
    # step through the fused norm + qkv, the gate_up and the SiLU + down launches, with
    # the weight's scales: the float32 layers on the dequantized weights, to the order of
    # the sums
    from vllmpy.layers.linear import PackedLinear, rms_norm_linear
    from vllmpy.layers.mlp import GatedMLP
    from vllmpy.layers.norm import RMSNorm
    from vllmpy.layers.quantization.fp8 import Fp8LinearMethod, dequantize_block
    from vllmpy.ops import skinny_gemm as skinny_module

    g = torch.Generator().manual_seed(9)
    block = (16, 32) if scheme == "block" else None
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=g) + 0.5
    qkv = PackedLinear(64, {"q": 32, "k": 16, "v": 16})
    mlp = GatedMLP(64, 48)
    dense = {}
    for linear in (qkv, mlp.gate_up_proj, mlp.down_proj):
        linear.set_method(Fp8LinearMethod(scheme, block=block))
        linear.method.on_cuda = True  # keep the fp8 tensors (the CPU would dequantize)
        linear.method.load_dense(linear, torch.randn(linear.output_size, linear.input_size,
                                                     generator=g))
        linear.method.skinny = skinny_module
        scale = linear.stream_scale.scale
        dense[linear] = (dequantize_block(linear.weight, scale, block, torch.float32)
                         if block else linear.weight.float() * scale)
        assert linear.streams_one_row(torch.zeros(1, linear.input_size))
        assert not linear.streams_one_row(torch.zeros(2, linear.input_size))
    for module in (norm, qkv, mlp):
        module.to(DEVICE)
    x = torch.randn(1, 64, generator=g).to(DEVICE)
    res = torch.randn(1, 64, generator=g).to(DEVICE)
    out, total = rms_norm_linear(norm, qkv, x, res)
    ref, ref_total = rms_norm_gemm_ref(x, res, norm.weight, 1e-6, dense[qkv].to(DEVICE))
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    gate_up = F.linear(x, dense[mlp.gate_up_proj].to(DEVICE))
    ref_down = silu_mul_gemm_ref(gate_up, dense[mlp.down_proj].to(DEVICE))
    torch.testing.assert_close(mlp(x), ref_down, rtol=1e-5, atol=1e-4)
