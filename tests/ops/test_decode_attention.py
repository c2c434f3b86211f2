"""The one-launch decode attention (vllmpy.ops.decode_attention) against the references of
the kernels it replaces: (q/k norm +) rotary, the cache write, and paged attention.

Without CUDA the kernel runs under Triton's interpreter in fp32; with CUDA also in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from vllmpy.attention.metadata import AttentionMetadata  # noqa: E402
from vllmpy.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from vllmpy.layers.attention import SelfAttention  # noqa: E402
from vllmpy.layers.rotary import RotaryEmbedding  # noqa: E402
from vllmpy.ops.decode_attention import decode_attention, supports  # noqa: E402
from vllmpy.ops.fused import qk_norm_rotary_ref, rotary_embedding_ref  # noqa: E402
from vllmpy.ops.paged_attention import (  # noqa: E402
    FP8_KV_DTYPE,
    paged_attention_ref,
    reshape_and_cache_ref,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-6


def make_step(seq_lens, heads, kv_heads, dim, block_size, dtype, seed=0):
    """A decode step: one new token per request, its earlier keys and values already in a
    random cache whose blocks are scattered over the pool. A request of length 0 is a
    padding row, as CUDA graphs pad a batch: slot -1, nothing to attend to."""
    gen = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    blocks = [max(1, -(-s // block_size)) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(n, max(blocks) + 1, dtype=torch.int32)
    used = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = perm[used:used + b]
        used += b
    slots = []
    for i, s in enumerate(seq_lens):
        last = max(s - 1, 0)
        slot = int(tables[i, last // block_size]) * block_size + last % block_size
        slots.append(-1 if s == 0 else slot)
    width = (heads + 2 * kv_heads) * dim
    step = dict(
        qkv=torch.randn(n, width, generator=gen).to(DEVICE, dtype),
        positions=torch.tensor([max(s - 1, 0) for s in seq_lens], dtype=torch.int64,
                               device=DEVICE),
        kv_cache=torch.randn(2, num_blocks, block_size, kv_heads, dim,
                             generator=gen).to(DEVICE, dtype),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
    )
    rotary = RotaryEmbedding(dim, 4096, 10000.0)
    step["cos_sin_cache"] = rotary.cos_sin_cache(DEVICE)
    return step


def reference(step, heads, kv_heads, dim, q_w=None, k_w=None):
    """The separate path: (norm +) rotary, the cache write, paged attention (fp32)."""
    q, k, v = step["qkv"].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    if q_w is not None:
        q, k = qk_norm_rotary_ref(step["positions"], q, k, q_w, k_w, EPS,
                                  step["cos_sin_cache"], dim)
    else:
        q, k = rotary_embedding_ref(step["positions"], q, k, step["cos_sin_cache"], dim)
    cache = step["kv_cache"].clone()
    n = q.shape[0]
    reshape_and_cache_ref(k.reshape(n, kv_heads, dim), v.reshape(n, kv_heads, dim), cache,
                          step["slot_mapping"])
    out = paged_attention_ref(q.reshape(n, heads, dim), cache, step["query_start_loc"],
                              step["seq_lens"], step["block_tables"],
                              scale=1 / math.sqrt(dim))
    return out, cache


def run(step, heads, num_splits, q_w=None, k_w=None, min_tiles=1):
    cache = step["kv_cache"].clone()
    args = {key: val for key, val in step.items() if key not in ("kv_cache", "query_start_loc")}
    out = decode_attention(kv_cache=cache, num_heads=heads, scale=1 / math.sqrt(cache.shape[-1]),
                           max_seq_len=int(step["seq_lens"].max()), num_splits=num_splits,
                           q_norm_weight=q_w, k_norm_weight=k_w, eps=EPS,
                           min_tiles_per_split=min_tiles, **args)
    return out, cache


# a long decode, a request whose only key is its new token, a padding row (seq_len 0),
# short ones; the new tokens fall at tile and block boundaries and inside them
SEQ_LENS = [150, 1, 0, 65, 64, 7]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits,min_tiles", [(1, 1), (3, 1), (8, 1), (8, 2), (4, 3)])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_matches_the_separate_kernels(dtype, num_splits, min_tiles, qk_norm):
    heads, kv_heads, dim, block_size = 4, 2, 32, 16
    step = make_step(SEQ_LENS, heads, kv_heads, dim, block_size, dtype)
    gen = torch.Generator().manual_seed(1)
    q_w = k_w = None
    if qk_norm:
        q_w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE, dtype)
        k_w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE, dtype)
    ref, ref_cache = reference(step, heads, kv_heads, dim, q_w, k_w)
    out, cache = run(step, heads, num_splits, q_w, k_w, min_tiles)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # the new keys (normed and rotated) and values landed where the separate write puts
    # them, and nothing else changed (the padding row stores nothing)
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=tol, rtol=tol)
    assert torch.equal(cache != step["kv_cache"], ref_cache != step["kv_cache"])


@pytest.mark.skipif(not CUDA, reason="a model-sized step needs a GPU")
def test_qwen3_8b_geometry_bf16():
    heads, kv_heads, dim, block_size = 32, 8, 128, 16
    step = make_step([768, 5, 2047, 300], heads, kv_heads, dim, block_size, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    q_w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE, torch.bfloat16)
    k_w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE, torch.bfloat16)
    ref, ref_cache = reference(step, heads, kv_heads, dim, q_w, k_w)
    out, cache = run(step, heads, None, q_w, k_w)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache.float(), ref_cache.float(), atol=0, rtol=0)


def test_refusals_name_what_is_wrong():
    heads, kv_heads, dim = 4, 2, 32
    step = make_step([5, 9], heads, kv_heads, dim, 16, torch.float32)
    bad_qkv = dict(step, qkv=step["qkv"][:, :-1])
    with pytest.raises(ValueError, match=r"qkv must be \[2, 256\]"):
        run(bad_qkv, heads, 1)
    with pytest.raises(ValueError, match="q_norm_weight and k_norm_weight go together"):
        run(step, heads, 1, q_w=torch.ones(dim, device=DEVICE))
    with pytest.raises(ValueError, match=r"k_norm_weight must be a contiguous \[32\]"):
        run(step, heads, 1, q_w=torch.ones(dim, device=DEVICE),
            k_w=torch.ones(dim + 1, device=DEVICE))
    bad_pos = dict(step, positions=step["positions"][:1])
    with pytest.raises(ValueError, match="positions must be"):
        run(bad_pos, heads, 1)
    with pytest.raises(ValueError, match="min_tiles_per_split must be at least 1"):
        run(step, heads, 2, min_tiles=0)
    fp8 = torch.zeros(2, 4, 16, kv_heads, dim, dtype=FP8_KV_DTYPE, device=DEVICE)
    assert not supports(dim, fp8, torch.float32)
    assert not supports(96, step["kv_cache"], torch.float32)  # half of 96 is 48
    assert supports(dim, step["kv_cache"], torch.float32)


def _meta(step, max_query_len):
    n = step["seq_lens"].shape[0]
    return AttentionMetadata(
        num_actual_tokens=n, query_start_loc=step["query_start_loc"],
        query_start_loc_cpu=list(range(n + 1)), seq_lens=step["seq_lens"],
        seq_lens_cpu=step["seq_lens"].tolist(), slot_mapping=step["slot_mapping"],
        block_tables=step["block_tables"], block_size=step["kv_cache"].shape[2],
        max_query_len=max_query_len, max_seq_len=int(step["seq_lens"].max()))


def test_the_backend_takes_decode_steps_only():
    heads, kv_heads, dim = 4, 2, 32
    step = make_step([20, 3], heads, kv_heads, dim, 16, torch.float32)
    backend = TritonAttentionBackend(heads, kv_heads, dim, 1 / math.sqrt(dim), num_splits=2)
    # a block without q/k norms: the backend fuses a decode step whole, or nothing
    block = SelfAttention(16, heads, kv_heads, dim, rotary=RotaryEmbedding(dim, 4096, 10000.0))
    cache = step["kv_cache"].clone()
    out = backend.fused_qkv(block, step["qkv"], step["positions"], cache, _meta(step, 1))
    ref, _ = reference(step, heads, kv_heads, dim)
    torch.testing.assert_close(out, ref.reshape(2, -1), atol=1e-5, rtol=1e-5)
    # a step with a longer query, or a cache it cannot write, takes the separate path
    assert backend.fused_qkv(block, step["qkv"], step["positions"], cache,
                             _meta(step, 2)) is None
    fp8 = torch.zeros(cache.shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    assert backend.fused_qkv(block, step["qkv"], step["positions"], fp8,
                             _meta(step, 1)) is None
