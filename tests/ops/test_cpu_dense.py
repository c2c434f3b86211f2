"""The float32 panel kernel (``vllmpy.ops.cpu_dense``): F.linear's values (against a
float64 product) for every tile height and a last panel part-filled, strided inputs and
outputs, and a row's bits the same whatever the call's row count or the row's place in
it (what a speculative verify and a batch rely on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllmpy.ops import cpu_dense, cpu_kernels


@pytest.fixture(autouse=True)
def kernels():
    if cpu_kernels.kernels() is None:
        pytest.skip(f"CPU kernels: {cpu_kernels.status()}")


def exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("rows,cols", [(16, 8), (37, 53), (96, 40), (130, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_values_equal_f_linear_at_every_tile_height(rows, cols, bias):
    gen = torch.Generator().manual_seed(rows * cols)
    w = torch.randn(rows, cols, generator=gen)
    b = torch.randn(rows, generator=gen) if bias else None
    packed = cpu_dense.pack(w)
    assert packed.panels.numel() == -(-rows // 16) * 16 * cols
    # tiles of 1-6 rows and their remainders; more rows than a chunk holds (here 192)
    for m in (1, 2, 3, 4, 5, 6, 7, 12, 13, 19, 200):
        x = torch.randn(m, cols, generator=gen)
        got = cpu_dense.linear(x, packed, b)
        assert got.shape == (m, rows) and got.dtype == torch.float32
        # float32 sums of ~sqrt(cols)-sized terms, one chain each: a few ulps of the terms
        torch.testing.assert_close(got.double(), exact(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_row_keeps_its_bits_at_every_row_count_and_place():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(72, 96, generator=gen), torch.randn(72, generator=gen)
    packed = cpu_dense.pack(w)
    x = torch.randn(210, 96, generator=gen)  # more rows than a chunk (192): two chunks
    alone = torch.cat([cpu_dense.linear(x[i:i + 1], packed, b) for i in range(210)])
    for m in (2, 5, 6, 7, 11, 23, 210):
        for start in (0, 210 - m):
            assert torch.equal(cpu_dense.linear(x[start:start + m], packed, b),
                               alone[start:start + m]), (m, start)


def test_strided_weight_inputs_and_outputs():
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(40, 70, generator=gen)
    w = wide[:, 5:69]  # rows with a stride of 70
    packed = cpu_dense.pack(w)
    xs = torch.randn(9, 100, generator=gen)[:, 10:74]  # rows with a stride of 100
    out = torch.full((9, 50), -1.0)
    cpu_dense.linear(xs, packed, None, out[:, 3:43])
    torch.testing.assert_close(out[:, 3:43].double(), exact(xs, w, None), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(out[:, :3], torch.full((9, 3), -1.0))  # nothing written beside it
    assert torch.equal(out[:, 43:], torch.full((9, 7), -1.0))
    batched = cpu_dense.linear(xs.reshape(3, 3, 64), packed)
    assert batched.shape == (3, 3, 40)
    assert torch.equal(batched.reshape(9, 40), out[:, 3:43])
