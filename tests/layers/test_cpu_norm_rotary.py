"""The CPU paths of RMSNorm and rotary against their PyTorch references: the same numbers,
up to the last unit of a half-precision RMSNorm."""

from __future__ import annotations

import pytest
import torch

from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.ops.native import rms_norm_cpu, rms_norm_torch, rotary_cpu, rotary_torch

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 576), (64, 576), (17, 64), (5, 3, 32), (300, 100)]


def norm_inputs(shape, dtype, scale, seed=0):
    """Random rows with one large outlier each, as real activations have; at scale 1e-3
    mean(x^2) is as small as eps, so a misplaced eps shows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * scale
    x[..., 1] += 40 * scale
    weight = torch.rand(shape[-1], generator=gen) + 0.5
    return x.to(dtype), weight.to(dtype)


@pytest.mark.parametrize("scale", [7.0, 1e-3])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_cpu_in_float32_is_bitwise_the_reference(shape, scale):
    x, weight = norm_inputs(shape, torch.float32, scale)
    assert torch.equal(rms_norm_cpu(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [7.0, 1e-3])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_cpu_in_half_precision_rounds_like_the_reference(dtype, shape, scale):
    """One unit in the last place of the normalised value at most (two after the weight's
    rounding), on a small fraction of the values."""
    x, weight = norm_inputs(shape, dtype, scale)
    out, expected = rms_norm_cpu(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=2 * ulp)
    assert (out != expected).float().mean().item() <= 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_layer_on_the_cpu_adds_the_residual_then_normalises(dtype):
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(48, eps=1e-6)
    norm.weight.data = (torch.rand(48, generator=gen) + 0.5).to(dtype)
    x, residual = (torch.randn(6, 48, generator=gen).to(dtype) for _ in range(2))
    out, total = norm(x, residual)
    assert torch.equal(total, x + residual)
    assert torch.equal(out, rms_norm_cpu(x + residual, norm.weight, 1e-6))
    assert torch.equal(norm(x), rms_norm_cpu(x, norm.weight, 1e-6))
    tol = 0 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(out, rms_norm_torch(x + residual, norm.weight, 1e-6),
                               atol=0, rtol=tol)


ROPES = {
    "default": (64, 10000.0, None),
    "llama3": (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 256}),
    "linear": (32, 10000.0, {"type": "linear", "factor": 2.0}),
    "partial": (64, 10000.0, {"rope_type": "default", "partial_rotary_factor": 0.5}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
def test_rotary_cpu_is_bitwise_the_reference(dtype, rope, heads, kv_heads):
    head_dim, base, scaling = ROPES[rope]
    emb = RotaryEmbedding(head_dim, 1024, base, scaling)
    gen = torch.Generator().manual_seed(2)
    n = 13
    # q and k as the split of one qkv projection, as models pass them
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen) * 5).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 1024, (n,), generator=gen)
    expected = rotary_torch(positions, q, k, emb.cos_sin_cache(torch.device("cpu")), head_dim)
    got = emb(positions, q, k)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)
    # [num_tokens, heads, head_dim] inputs keep their shape
    q3, k3 = q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim)
    got3 = rotary_cpu(positions, q3, k3, emb.cpu_table(q.device), head_dim)
    assert got3[0].shape == q3.shape and torch.equal(got3[0].reshape(n, -1), expected[0])


def test_rotary_cpu_table_is_shared_by_layers_with_the_same_settings_only():
    a, b = RotaryEmbedding(64, 512, 10000.0), RotaryEmbedding(64, 512, 10000.0)
    c = RotaryEmbedding(64, 512, 10000.0, {"type": "linear", "factor": 2.0})
    cpu = torch.device("cpu")
    assert a.cpu_table(cpu) is b.cpu_table(cpu)
    assert a.cpu_table(cpu).shape == (512, 2, 1, 64)
    assert not torch.equal(a.cpu_table(cpu), c.cpu_table(cpu))
