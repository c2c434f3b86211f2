"""The grouped-GEMM MoE kernels against the layer's PyTorch reference (under Triton's
interpreter on the CPU), on random routings with experts that get no token, one token,
and every token."""

from __future__ import annotations

import pytest
import torch

from vllmpy.layers.moe import moe_reference, select_experts
from vllmpy.ops.fused_moe import BLOCK_M, align_by_expert, fused_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(e: int, h: int, i: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(DEVICE, dtype)
    return w13, w2


def test_align_pads_each_expert_run() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [2, 0]], device=DEVICE)
    sorted_pairs, block_expert = align_by_expert(ids, 5)
    pairs = sorted_pairs.tolist()
    experts = block_expert.tolist()
    seen = {}
    for b, e in enumerate(experts):
        block = pairs[b * BLOCK_M:(b + 1) * BLOCK_M]
        real = [p for p in block if p < 6]
        if e == 5:
            assert not real
            continue
        seen.setdefault(e, []).extend(real)
        assert all(ids.reshape(-1)[p].item() == e for p in real)
    assert seen == {0: [1, 5], 2: [0, 2, 4], 3: [3]}  # expert 1 and 4 get no block


@pytest.mark.parametrize("pairs,experts", [(1, 4), (6, 5), (64, 128), (64, 3)])
def test_one_program_alignment_equals_the_sort(pairs: int, experts: int) -> None:
    g = torch.Generator().manual_seed(pairs + experts)
    ids = torch.randint(0, experts, (pairs, 1), generator=g).to(DEVICE)
    kernel = align_by_expert(ids, experts, one_program=True)
    sort = align_by_expert(ids, experts, one_program=False)
    assert torch.equal(kernel[0], sort[0]) and torch.equal(kernel[1], sort[1])


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 4), (7, 2, 8), (40, 3, 6)])
def test_matches_reference_on_random_routings(tokens: int, top_k: int, experts: int) -> None:
    h, i = 48, 40  # neither a multiple of the 64-wide tiles
    w13, w2 = _weights(experts, h, i, torch.float32, tokens)
    g = torch.Generator().manual_seed(tokens + 1)
    x = torch.randn(tokens, h, generator=g).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=g).to(DEVICE)
    weights, ids = select_experts(logits, top_k, True)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_no_one_and_every_token() -> None:
    w13, w2 = _weights(5, 32, 16, torch.float32, 9)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    ids = torch.tensor([[0, 1]] + [[4, 0]] * 19, device=DEVICE)  # 0 all, 1 one, 2 and 3 none
    weights = torch.rand(20, 2, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_bfloat16() -> None:
    w13, w2 = _weights(4, 64, 32, torch.bfloat16, 12)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(13)).to(DEVICE,
                                                                          torch.bfloat16)
    weights, ids = select_experts(torch.randn(9, 4, generator=torch.Generator().manual_seed(
        14)).to(DEVICE), 2, False)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2.0**-6 * scale)


def test_refusals() -> None:
    w13, w2 = _weights(2, 8, 4, torch.float32, 1)
    x = torch.randn(3, 8, device=DEVICE)
    ids = torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    weights = torch.ones(3, 1, device=DEVICE)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, w13.half(), w2, weights, ids)


# ---- FP8 experts: codes with per-tensor or block scales, activations in x's dtype ----

FP8 = torch.float8_e4m3fn


def _fp8_experts(e: int, h: int, i: int, block: tuple[int, int] | None, seed: int):
    """Random fp8 codes and positive scales: w13 [E, 2I, H] with scales [E, 2] or
    [E, 2 * ceil(I / bn), ceil(H / bk)] (gate's grid, then up's), w2 [E, H, I] with [E]
    or [E, ceil(H / bn), ceil(I / bk)]."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 40).to(FP8)
    w2 = (torch.randn(e, h, i, generator=g) * 40).to(FP8)
    if block is None:
        s13, s2 = torch.rand(e, 2, generator=g) * 0.01 + 0.002, torch.rand(e, generator=g) * 0.01
    else:
        bn, bk = block
        cdiv = lambda a, b: -(-a // b)  # noqa: E731
        s13 = torch.rand(e, 2 * cdiv(i, bn), cdiv(h, bk), generator=g) * 0.01 + 0.002
        s2 = torch.rand(e, cdiv(h, bn), cdiv(i, bk), generator=g) * 0.01 + 0.002
    return w13, s13, w2, s2


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, block, rows_per_proj: int,
                projs: int) -> torch.Tensor:
    """codes [E, N, K] times each element's scale (the test's own expansion)."""
    e, n, k = codes.shape
    full = torch.empty(e, n, k)
    for p in range(projs):  # each projection's rows take its own scales
        rows = slice(p * rows_per_proj, (p + 1) * rows_per_proj)
        if block is None:
            s = scale.reshape(e, projs)[:, p][:, None, None].expand(e, rows_per_proj, k)
        else:
            bn, bk = block
            grid_rows = scale.shape[1] // projs
            grid = scale[:, p * grid_rows:(p + 1) * grid_rows]
            r = torch.arange(rows_per_proj) // bn
            c = torch.arange(k) // bk
            s = grid[:, r][:, :, c]
        full[:, rows] = s
    return codes.float() * full


def _per_token_reference(x, w13, w2, weights, ids):
    """A plain loop over tokens and their chosen experts, in fp32."""
    i = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t].float()
            act = torch.nn.functional.silu(h[:i]) * h[i:]
            out[t] += float(weights[t, j]) * (w2[e] @ act)
    return out


def _fp8_case(block, tokens, top_k, experts, seed, h=200, i=136):
    w13, s13, w2, s2 = _fp8_experts(experts, h, i, block, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, h, generator=g)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, True)
    dense13 = _dequantize(w13, s13, block, i, 2)
    dense2 = _dequantize(w2, s2, block, h, 1)
    return x, (w13, s13, w2, s2), (dense13, dense2), weights, ids


def _run_fp8(x, q, weights, ids, block, **kw):
    w13, s13, w2, s2 = q
    return fused_moe(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE),
                     ids.to(DEVICE), w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE),
                     scale_block=block, **kw).cpu()


BLOCKS = {"tensor": None, "block128": (128, 128), "block32x64": (32, 64)}


@pytest.mark.parametrize("scales", list(BLOCKS))
@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 4), (40, 3, 6)])
def test_fp8_matches_a_per_token_reference(scales: str, tokens: int, top_k: int,
                                           experts: int) -> None:
    # H 200 and I 136 are multiples of neither the tiles nor the 128-wide scale blocks
    block = BLOCKS[scales]
    x, q, (d13, d2), weights, ids = _fp8_case(block, tokens, top_k, experts, tokens + top_k)
    out = _run_fp8(x, q, weights, ids, block)
    ref = _per_token_reference(x, d13, d2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("scales", ["tensor", "block128"])
def test_fp8_no_one_and_every_token(scales: str) -> None:
    block = BLOCKS[scales]
    x, q, (d13, d2), _, _ = _fp8_case(block, 20, 2, 5, 21)
    ids = torch.tensor([[0, 1]] + [[4, 0]] * 19)  # 0 every token, 1 one, 2 and 3 none
    weights = torch.rand(20, 2, generator=torch.Generator().manual_seed(22))
    out = _run_fp8(x, q, weights, ids, block)
    ref = _per_token_reference(x, d13, d2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("tokens", [1, 40])  # the decode tiles and the prefill tiles
def test_fp8_reads_only_the_chosen_experts(tokens: int) -> None:
    block = (128, 128)
    x, q, (d13, d2), _, _ = _fp8_case(block, tokens, 2, 6, 31)
    ids = torch.tensor([[1, 4]] * tokens)
    weights = torch.rand(tokens, 2, generator=torch.Generator().manual_seed(32))
    w13, s13, w2, s2 = (t.clone() for t in q)
    for e in (0, 2, 3, 5):  # NaN codes and scales in every expert no token chose
        w13[e], w2[e] = float("nan"), float("nan")
        s13[e], s2[e] = float("nan"), float("nan")
    out = _run_fp8(x, (w13, s13, w2, s2), weights, ids, block)
    ref = _per_token_reference(x, d13, d2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_fp8_with_bfloat16_activations_and_biases() -> None:
    block = (128, 128)
    x, q, (d13, d2), weights, ids = _fp8_case(block, 9, 2, 4, 41)
    g = torch.Generator().manual_seed(42)
    b13, b2 = torch.randn(4, 2 * 136, generator=g), torch.randn(4, 200, generator=g)
    w13, s13, w2, s2 = q
    out = fused_moe(x.to(DEVICE, torch.bfloat16), w13.to(DEVICE), w2.to(DEVICE),
                    weights.to(DEVICE), ids.to(DEVICE), b13.to(DEVICE, torch.bfloat16),
                    b2.to(DEVICE, torch.bfloat16), w13_scale=s13.to(DEVICE),
                    w2_scale=s2.to(DEVICE), scale_block=block).cpu()
    assert out.dtype == torch.bfloat16
    ref = moe_reference(x.to(torch.bfloat16).float(), d13, d2, weights, ids,
                        b13.to(torch.bfloat16).float(), b2.to(torch.bfloat16).float())
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2.0**-6 * scale)


def test_fp8_refusals() -> None:
    w13, s13, w2, s2 = (t.to(DEVICE) for t in _fp8_experts(2, 64, 32, (128, 128), 1))
    x = torch.randn(3, 64, device=DEVICE)
    ids = torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    weights = torch.ones(3, 1, device=DEVICE)
    with pytest.raises(ValueError, match="w13_scale and w2_scale"):
        fused_moe(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=s13[:, :1], w2_scale=s2,
                  scale_block=(128, 128))
    with pytest.raises(ValueError, match="per-tensor"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=torch.ones(2, 3, device=DEVICE),
                  w2_scale=s2)
    with pytest.raises(ValueError, match="multiple of 16"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=torch.ones(2, 2, 8, device=DEVICE),
                  w2_scale=torch.ones(2, 1, 4, device=DEVICE), scale_block=(128, 8))
