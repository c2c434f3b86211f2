"""The fused RMSNorm, rotary and SiLU-and-mul kernels against their PyTorch references.

Without CUDA the kernels run under Triton's interpreter on tiny fp32 shapes; with CUDA
they also run in bf16 and fp16 on model-sized shapes, and the layers take them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vllmpy.layers.activation import SiluAndMul  # noqa: E402
from vllmpy.layers.norm import RMSNorm  # noqa: E402
from vllmpy.layers.rotary import RotaryEmbedding  # noqa: E402
from vllmpy.ops.fused import (  # noqa: E402
    qk_norm_rotary,
    qk_norm_rotary_ref,
    rms_norm,
    rms_norm_ref,
    rotary_embedding,
    rotary_embedding_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if CUDA else [])
# One unit in the last place of the output dtype (relative), plus slack for fp32's
# different reduction order and fused multiply-adds.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# ---- rms_norm ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 48])  # a power of two, and one that is not
def test_rms_norm_matches_reference(dtype, hidden):
    x = randn(5, hidden, dtype=dtype) * 3
    weight = randn(hidden, dtype=dtype, seed=1)
    assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_norm_and_sum(dtype):
    x, res = randn(4, 40, dtype=dtype), randn(4, 40, dtype=dtype, seed=1)
    weight = randn(40, dtype=dtype, seed=2)
    out, total = rms_norm(x, weight, 1e-5, res)
    ref_out, ref_total = rms_norm_ref(x, weight, 1e-5, res)
    torch.testing.assert_close(total, ref_total, atol=0, rtol=0)  # one rounded add
    assert_close(out, ref_out, dtype)


def test_rms_norm_per_head_over_a_slice_of_packed_qkv():
    # Qwen3's q_norm: [tokens, heads, head_dim] viewed out of a wider qkv row, no copy
    qkv = randn(3, 4 * 16 + 32)
    q = qkv[:, :64].reshape(3, 4, 16)  # [tokens, heads, head_dim], strides (96, 16, 1)
    weight = randn(16, seed=1)
    out = rms_norm(q, weight, 1e-6)
    assert out.shape == (3, 4, 16) and out.is_contiguous()
    assert_close(out, rms_norm_ref(q, weight, 1e-6), torch.float32)


def test_rms_norm_launcher_names_bad_arguments():
    x = randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, randn(7), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm(x, randn(8), 1e-6, randn(2, 8).double())
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        rms_norm(x.t(), randn(2), 1e-6)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        rms_norm(x.long(), randn(8), 1e-6)


# ---- rotary_embedding --------------------------------------------------------------------

def make_rotary_inputs(tokens, heads, kv_heads, dim, dtype, packed=False):
    rope = RotaryEmbedding(dim, max_position=64, base=10000.0)
    cache = rope.cos_sin_cache(DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(3))
    if packed:  # q and k as slices of one [tokens, (heads + 2 * kv_heads) * dim] qkv
        qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
        q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    else:
        q = randn(tokens, heads * dim, dtype=dtype)
        k = randn(tokens, kv_heads * dim, dtype=dtype, seed=1)
    return positions.to(DEVICE), q, k, cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,packed", [
    (4, 2, 16, False), (3, 3, 8, True), (2, 1, 12, False)])  # GQA; MHA from qkv; odd sizes
def test_rotary_matches_reference_and_leaves_inputs_alone(dtype, heads, kv_heads, dim, packed):
    positions, q, k, cache = make_rotary_inputs(5, heads, kv_heads, dim, dtype, packed)
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = rotary_embedding(positions, q, k, cache, dim)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache, dim)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_rotary_launcher_names_bad_arguments():
    positions, q, k, cache = make_rotary_inputs(3, 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_embedding(positions.float(), q, k, cache, 8)
    with pytest.raises(ValueError, match="k must be"):
        rotary_embedding(positions, q, k[:2], cache, 8)
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        rotary_embedding(positions, q, k, cache.half(), 8)
    with pytest.raises(ValueError, match="head_dim must be"):
        rotary_embedding(positions, q, k, cache, 7)


# ---- qk_norm_rotary ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,packed", [
    (4, 2, 16, True), (3, 3, 8, False), (2, 1, 12, True)])
def test_qk_norm_rotary_matches_norms_then_rotary(dtype, heads, kv_heads, dim, packed):
    positions, q, k, cache = make_rotary_inputs(5, heads, kv_heads, dim, dtype, packed)
    qw, kw = randn(dim, dtype=dtype, seed=3), randn(dim, dtype=dtype, seed=4)
    q_out, k_out = qk_norm_rotary(positions, q, k, qw, kw, 1e-6, cache, dim)
    q_ref, k_ref = qk_norm_rotary_ref(positions, q, k, qw, kw, 1e-6, cache, dim)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slots", [[5, 0, 9, 14, 3], [7, -1, 2], []])
def test_qk_norm_rotary_stores_keys_and_values_as_reshape_and_cache(dtype, slots):
    from vllmpy.ops.paged_attention import reshape_and_cache

    heads, kv_heads, dim, block_size = 4, 2, 16, 4
    positions, q, k, cache = make_rotary_inputs(5, heads, kv_heads, dim, dtype, packed=True)
    v = randn(5, kv_heads * dim, dtype=dtype, seed=9)
    qw, kw = randn(dim, dtype=dtype, seed=3), randn(dim, dtype=dtype, seed=4)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    kv_cache = torch.full((2, 4, block_size, kv_heads, dim), 7.0, dtype=dtype, device=DEVICE)
    expected = kv_cache.clone()
    q_out, k_out = qk_norm_rotary(positions, q, k, qw, kw, 1e-6, cache, dim, v, kv_cache,
                                  slot_mapping)
    q_ref, k_ref = qk_norm_rotary(positions, q, k, qw, kw, 1e-6, cache, dim)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    n = len(slots)  # rows past the slots (and slot -1) store nothing
    reshape_and_cache(k_ref[:n].view(n, kv_heads, dim), v[:n].view(n, kv_heads, dim),
                      expected, slot_mapping)
    assert torch.equal(kv_cache, expected)


def test_qk_norm_rotary_store_names_bad_arguments():
    positions, q, k, cache = make_rotary_inputs(3, 2, 1, 8, torch.float32)
    w, v = randn(8), randn(3, 8)
    kv = torch.zeros(2, 2, 4, 1, 8, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="needs v, kv_cache and slot_mapping"):
        qk_norm_rotary(positions, q, k, w, w, 1e-6, cache, 8, None, kv, slots)
    with pytest.raises(ValueError, match="v must match k"):
        qk_norm_rotary(positions, q, k, w, w, 1e-6, cache, 8, v[:, :4], kv, slots)
    with pytest.raises(ValueError, match="kv_cache must be \\[2, num_blocks"):
        qk_norm_rotary(positions, q, k, w, w, 1e-6, cache, 8, v, kv[:, :, :, :, :4], slots)
    with pytest.raises(ValueError, match="kv_cache must be of q's dtype"):
        qk_norm_rotary(positions, q, k, w, w, 1e-6, cache, 8, v, kv.double(), slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        qk_norm_rotary(positions, q, k, w, w, 1e-6, cache, 8, v, kv, torch.arange(4))


def test_qk_norm_rotary_names_bad_arguments():
    positions, q, k, cache = make_rotary_inputs(3, 2, 1, 8, torch.float32)
    w = randn(8)
    with pytest.raises(ValueError, match="q_weight must be"):
        qk_norm_rotary(positions, q, k, randn(6), w, 1e-6, cache, 8)
    with pytest.raises(ValueError, match="k_weight must be"):
        qk_norm_rotary(positions, q, k, w, w.double(), 1e-6, cache, 8)
    with pytest.raises(ValueError, match="k must be"):
        qk_norm_rotary(positions, q, k[:2], w, w, 1e-6, cache, 8)


# ---- silu_and_mul ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 40])
def test_silu_and_mul_matches_reference(dtype, d):
    x = randn(6, 2 * d, dtype=dtype) * 4
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), dtype)


def test_silu_and_mul_launcher_names_bad_arguments():
    with pytest.raises(ValueError, match="2 \\* d"):
        silu_and_mul(randn(2, 7))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        silu_and_mul(randn(8, 2).t())


def test_empty_batches_launch_nothing():
    assert rms_norm(randn(0, 8), randn(8), 1e-6).shape == (0, 8)
    assert silu_and_mul(randn(0, 8)).shape == (0, 4)
    positions, q, k, cache = make_rotary_inputs(0, 2, 1, 8, torch.float32)
    q_out, k_out = rotary_embedding(positions, q, k, cache, 8)
    assert q_out.shape == (0, 16) and k_out.shape == (0, 8)


# ---- model sizes and the layers on CUDA --------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_cuda_rms_norm_layer_takes_the_kernel_at_model_sizes(dtype, hidden):
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    norm.bind_device(torch.device(DEVICE))
    norm.weight.copy_(randn(hidden, dtype=dtype, seed=4))
    x, res = randn(37, hidden, dtype=dtype), randn(37, hidden, dtype=dtype, seed=1)
    assert_close(norm(x), rms_norm_ref(x, norm.weight, 1e-6), dtype)
    out, total = norm(x, res)
    ref_out, ref_total = rms_norm_ref(x, norm.weight, 1e-6, res)
    torch.testing.assert_close(total, ref_total, atol=0, rtol=0)
    assert_close(out, ref_out, dtype)
    # nearly every element matches the PyTorch path bit for bit; the rest by one ulp
    assert (out != ref_out).float().mean() < 0.02


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8)])
def test_cuda_rotary_layer_takes_the_kernel_at_model_sizes(dtype, heads, kv_heads):
    rope = RotaryEmbedding(128, max_position=4096, base=1e6)
    rope.bind_device(torch.device(DEVICE))
    positions = torch.randint(0, 4096, (37,), device=DEVICE)
    qkv = randn(37, (heads + 2 * kv_heads) * 128, dtype=dtype)
    q, k, _ = qkv.split([heads * 128, kv_heads * 128, kv_heads * 128], dim=-1)
    q_out, k_out = rope(positions, q, k)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, rope.cos_sin_cache(DEVICE), 128)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_silu_and_mul_layer_takes_the_kernel_at_model_sizes(dtype):
    x = randn(37, 2 * 3072, dtype=dtype) * 4
    act = SiluAndMul()
    act.bind_device(torch.device(DEVICE))
    out = act(x)
    ref = silu_and_mul_ref(x)
    assert_close(out, ref, dtype)
    assert (out != ref).float().mean() < 0.02
