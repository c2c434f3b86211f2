"""The variable-length encoder attention kernel against per-sequence PyTorch SDPA.

Without CUDA the kernel runs under Triton's interpreter on small float32 shapes (the
interpreter's ``tl.dot`` gives wrong results for bfloat16 inputs); with CUDA it also runs
in bfloat16.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from vllmpy.layers.encoder_attention import encoder_attention  # noqa: E402
from vllmpy.ops.encoder_attention import varlen_attention  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# a single token, lengths around the 64-query block and one over two blocks
LENGTHS = [1, 5, 64, 65, 130]


def cumulative(lengths: list[int]) -> list[int]:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


def fused_qkv(lengths, heads, kv_heads, dim, dtype, seed=0):
    """q, k, v as column slices of one [num_tokens, (heads + 2 * kv_heads) * dim] tensor,
    the way a fused qkv projection hands them over (a token's stride is the whole row)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    q, k, v = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    return (q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim),
            v.view(tokens, kv_heads, dim))


def sdpa_oracle(q, k, v, lengths, scale=None):
    """Each sequence on its own through PyTorch's SDPA in float32, the KV heads repeated
    for their query heads."""
    group = q.shape[1] // k.shape[1]
    starts = cumulative(lengths)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for a, b in zip(starts[:-1], starts[1:]):
        # [heads, length, dim]
        qs = q[a:b].float().transpose(0, 1)
        ks = k[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    return out


def cu_seqlens(lengths, dtype=torch.int32):
    return torch.tensor(cumulative(lengths), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("dim", [32, 24, 80])
def test_varlen_attention_matches_sdpa_per_sequence(dtype, heads, kv_heads, dim):
    """Mixed lengths in one launch, GQA and MHA, head widths that are and are not powers
    of two, on strided column slices of a fused qkv tensor."""
    q, k, v = fused_qkv(LENGTHS, heads, kv_heads, dim, dtype)
    assert q.stride(0) != heads * dim  # the strided case
    out = varlen_attention(q, k, v, cu_seqlens(LENGTHS), max(LENGTHS))
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), sdpa_oracle(q, k, v, LENGTHS),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_varlen_attention_takes_a_custom_scale():
    q, k, v = fused_qkv(LENGTHS, 4, 2, 32, torch.float32, seed=1)
    out = varlen_attention(q, k, v, cu_seqlens(LENGTHS), max(LENGTHS), scale=0.37)
    torch.testing.assert_close(out, sdpa_oracle(q, k, v, LENGTHS, scale=0.37),
                               atol=1e-5, rtol=1e-5)


def test_varlen_attention_writes_out_through_a_flat_view():
    """``out`` as a [num_tokens, heads * dim] buffer viewed per head, on contiguous
    inputs: the result lands in the buffer and is returned."""
    lengths = [3, 70]
    q, k, v = (t.contiguous() for t in fused_qkv(lengths, 4, 2, 32, torch.float32, seed=2))
    flat = torch.full((sum(lengths), 4 * 32), float("nan"), device=DEVICE)
    result = varlen_attention(q, k, v, cu_seqlens(lengths), max(lengths),
                              out=flat.view(-1, 4, 32))
    assert result.data_ptr() == flat.data_ptr()
    torch.testing.assert_close(flat.view(-1, 4, 32), sdpa_oracle(q, k, v, lengths),
                               atol=1e-5, rtol=1e-5)


def test_varlen_attention_refuses_bad_arguments():
    q, k, v = fused_qkv([2, 3], 4, 2, 16, torch.float32)
    cu = cu_seqlens([2, 3])
    with pytest.raises(ValueError, match="v has dtype torch.bfloat16 but q has torch.float32"):
        varlen_attention(q, k, v.to(torch.bfloat16), cu, 3)
    with pytest.raises(ValueError, match="not a multiple of k and v's 3 KV heads"):
        three = torch.zeros(5, 3, 16, device=DEVICE)
        varlen_attention(q, three, three, cu, 3)
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32"):
        varlen_attention(q, k, v, cu_seqlens([2, 3], torch.int64), 3)
    with pytest.raises(ValueError, match="k must be"):
        varlen_attention(q, k[:4], v, cu, 3)
    with pytest.raises(ValueError, match="out must have q's shape"):
        varlen_attention(q, k, v, cu, 3, out=torch.empty(5, 2, 16, device=DEVICE))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_encoder_attention_matches_sdpa_per_sequence(heads, kv_heads):
    """The layer over a step (on the CPU its length groups, on CUDA the varlen kernel),
    twice on one step's metadata, as a model's layers call it."""
    lengths = [7, 1, 66, 9]
    q, k, v = fused_qkv(lengths, heads, kv_heads, 32, torch.float32, seed=3)
    meta = types.SimpleNamespace(query_start_loc_cpu=cumulative(lengths))
    expected = sdpa_oracle(q, k, v, lengths, scale=0.2).reshape(sum(lengths), -1)
    for _ in range(2):
        out = encoder_attention(q, k, v, meta, scale=0.2)  # type: ignore[arg-type]
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
