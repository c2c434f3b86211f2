"""The skinny GEMM kernel against F.linear (runs under the Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllmpy.ops.skinny_gemm import MAX_ROWS, skinny_gemm

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
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        skinny_gemm(torch.randn(1, 16), torch.randn(4, 15))
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        skinny_gemm(torch.randn(1, 16), torch.randn(16, 4).t())
    with pytest.raises(ValueError, match="bias must be"):
        skinny_gemm(torch.randn(1, 16), torch.randn(4, 16), torch.randn(5))
