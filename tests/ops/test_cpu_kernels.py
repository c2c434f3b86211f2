"""The CPU's C kernels (vllmpy.ops.cpu_kernels) against PyTorch's references, and how the
library reports itself when it cannot be had. The decode attention kernel is checked with
the CPU backend in tests/attention (every feature, both paths)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllmpy.layers.activation import SiluAndMul
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.ops import cpu_kernels
from vllmpy.ops.native import rms_norm_torch, rotary_torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.fixture(scope="module")
def lib():
    built = cpu_kernels.kernels()
    if built is None:
        pytest.skip(f"CPU kernels: {cpu_kernels.status()}")
    return built


def rows_of(shape, dtype, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (33, 64), (5, 1000)])
def test_add_rms_norm_against_the_reference(lib, shape, dtype, residual, threads):
    x = rows_of(shape, dtype, 0)
    res = rows_of(shape, dtype, 1) if residual else None
    weight = (torch.rand(shape[1], generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    out, summed = cpu_kernels.add_rms_norm(lib, x, res, weight, 1e-6, threads)
    total = x if res is None else x + res
    if residual:
        assert torch.equal(summed, total)  # the sum rounds once, as PyTorch's add
    else:
        assert summed is None
    expected = rms_norm_torch(total, weight, 1e-6)
    # the normalised value may round one unit apart (fp32 sums in another order), and the
    # weight's product rounds once more
    tol = 4 * ULP[dtype] if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=tol)


def test_add_rms_norm_reads_strided_rows(lib):
    base = rows_of((6, 200), torch.bfloat16, 3)
    x, res = base[:, :100], base[:, 100:]  # row stride 200
    weight = torch.ones(100, dtype=torch.bfloat16)
    out, summed = cpu_kernels.add_rms_norm(lib, x, res, weight, 1e-5, 1)
    assert torch.equal(summed, x + res)
    torch.testing.assert_close(out.float(), rms_norm_torch(x + res, weight, 1e-5).float(),
                               atol=0, rtol=4 * ULP[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])  # whole heads, then a partial rotary
def test_rotary_neox_against_the_reference(lib, dtype, rotary_dim):
    tokens, heads, kv_heads, head_dim = 9, 4, 2, 64
    rope = RotaryEmbedding(head_dim, 512, 10000.0, rotary_dim=rotary_dim)
    cache = rope.cos_sin_cache(torch.device("cpu"))
    positions = torch.tensor([0, 1, 2, 100, 511, 7, 7, 300, 3], dtype=torch.int64)
    q = rows_of((tokens, heads * head_dim), dtype, 4)
    k = rows_of((tokens, kv_heads * head_dim), dtype, 5)
    expected_q, expected_k = rotary_torch(positions, q.clone(), k.clone(), cache, head_dim,
                                          is_neox_style=True)
    q2, k2 = q.clone(), k.clone()
    cpu_kernels.rotary_neox(lib, positions, q2, k2, cache, head_dim, 2)
    tol = 2 * ULP[dtype] if dtype != torch.float32 else 1e-6
    torch.testing.assert_close(q2.float(), expected_q.reshape(q.shape).float(), atol=tol,
                               rtol=tol)
    torch.testing.assert_close(k2.float(), expected_k.reshape(k.shape).float(), atol=tol,
                               rtol=tol)
    # the dims past rotary_dim pass through untouched
    assert torch.equal(q2.view(tokens, heads, head_dim)[..., rotary_dim:],
                       q.view(tokens, heads, head_dim)[..., rotary_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (40, 3072)])
def test_silu_and_mul_against_the_reference(lib, dtype, shape):
    x = rows_of(shape, dtype, 6, scale=6.0)
    x[0, :4] = torch.tensor([-90.0, 90.0, 0.0, -0.0]).to(dtype)  # exp's edges
    d = shape[1] // 2
    out = cpu_kernels.silu_and_mul(lib, x, cpu_kernels.threads_for(x.numel()))
    # PyTorch rounds silu to the dtype before the product; so does the kernel
    expected = F.silu(x[:, :d]) * x[:, d:]
    tol = 2 * ULP[dtype] if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=tol)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_bound_to_the_cpu_run_the_kernels(lib, dtype, monkeypatch):
    """RMSNorm, SiluAndMul and RotaryEmbedding bound to the CPU go through the kernels
    (counted), with PyTorch's numbers."""
    calls = []
    for name in ("add_rms_norm", "silu_and_mul", "rotary_neox"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name,
                            lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    cpu = torch.device("cpu")
    norm, act = RMSNorm(64, eps=1e-6), SiluAndMul()
    rope = RotaryEmbedding(32, 128, 10000.0)
    for layer in (norm, act, rope):
        layer.bind_device(cpu)
    norm.weight.data = (torch.rand(64) + 0.5).to(dtype)
    x, res = rows_of((3, 64), dtype, 7), rows_of((3, 64), dtype, 8)
    out, summed = norm(x, res)
    assert torch.equal(summed, x + res)
    tol = 4 * ULP[dtype] if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(out.float(), rms_norm_torch(x + res, norm.weight, 1e-6).float(),
                               atol=0, rtol=tol)
    torch.testing.assert_close(act(x).float(), (F.silu(x[:, :32]) * x[:, 32:]).float(),
                               atol=1e-6, rtol=tol)
    positions = torch.tensor([0, 5, 127])
    q, k = rows_of((3, 64), dtype, 9), rows_of((3, 32), dtype, 10)
    rq, rk = rope(positions, q, k)
    eq, ek = rotary_torch(positions, q.clone(), k.clone(), rope.cos_sin_cache(cpu), 32,
                          is_neox_style=True)
    torch.testing.assert_close(rq.float(), eq.reshape(q.shape).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(rk.float(), ek.reshape(k.shape).float(), atol=tol, rtol=tol)
    assert sorted(set(calls)) == ["add_rms_norm", "rotary_neox", "silu_and_mul"]


@pytest.fixture
def fresh_state(monkeypatch):
    """The module's loaded library forgotten for one test (and restored after it)."""
    monkeypatch.setattr(cpu_kernels, "_state", {})


def test_switched_off_by_the_environment(fresh_state, monkeypatch):
    monkeypatch.setenv("VT_CPU_KERNELS", "0")
    assert cpu_kernels.kernels() is None
    assert cpu_kernels.status() == "off (VT_CPU_KERNELS=0): PyTorch ops"


def test_without_a_compiler_the_status_says_so(fresh_state, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    assert cpu_kernels.kernels() is None
    assert cpu_kernels.status().startswith("not built (no C compiler")


def test_a_failed_build_names_the_compiler_error(fresh_state, monkeypatch, tmp_path):
    if cpu_kernels._compiler() is None:
        pytest.skip("no C compiler")
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", [broken])
    monkeypatch.setenv("VT_KERNEL_CACHE", str(tmp_path / "cache"))
    assert cpu_kernels.kernels() is None
    status = cpu_kernels.status()
    assert status.startswith("not built (") and "broken.c" in status
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-written library left


def test_a_build_is_cached_by_source(fresh_state, monkeypatch, tmp_path):
    if cpu_kernels._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("VT_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernels.kernels() is not None
    assert cpu_kernels.status().startswith("C kernels")
    built = list(tmp_path.glob("cpu_kernels-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(cpu_kernels, "_state", {})
    stamp = built[0].stat().st_mtime_ns
    assert cpu_kernels.kernels() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
