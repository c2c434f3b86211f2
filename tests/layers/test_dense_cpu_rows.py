"""A CPU bfloat16 product: through a oneDNN-packed copy of the weight where oneDNN has
bfloat16 kernels (the packed copy replaces the dense one at the first product), and as a
multiple of the row bucket and a remainder for many rows (a bounded set of oneDNN
kernels for steps of any token count). Either way the result is F.linear's, bit for bit.
A float32 product goes through a packed copy too: F.linear's values up to the order of
the sums, and a row's bits the same whatever the call's row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllmpy.layers.embedding import head_logits
from vllmpy.layers.linear import Linear
from vllmpy.layers.quantization.dense import CPU_BF16_ROW_BUCKET, cpu_packs

ROWS = [1, 7, CPU_BF16_ROW_BUCKET, CPU_BF16_ROW_BUCKET + 1, 200, 256]


def bf16_layer(bias: bool, seed: int, k: int = 40
               ) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    """A bound Linear(k, 96) in bfloat16 and copies of its weight and bias."""
    layer = Linear(k, 96, bias=bias)
    layer.bind_device(torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16) if bias else None
    layer.weight = torch.nn.Parameter(weight.clone(), False)
    if bias:
        layer.bias = torch.nn.Parameter(b.clone(), False)
    return layer, weight, b


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", ROWS)
def test_bfloat16_rows_equal_f_linear(bias, rows):
    layer, weight, b = bf16_layer(bias, rows)
    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight, b))
    assert torch.equal(layer(x[: rows // 2 + 1]), F.linear(x[: rows // 2 + 1], weight, b))


def test_packed_weight_replaces_the_dense_copy_and_takes_batched_inputs():
    layer, weight, b = bf16_layer(True, 3)
    if not cpu_packs(layer.weight):
        pytest.skip("this CPU's oneDNN has no bfloat16 kernels")
    x = torch.randn(3, 5, 40).to(torch.bfloat16)
    out = layer(x)
    assert out.shape == (3, 5, 96)
    assert torch.equal(out, F.linear(x, weight, b))
    assert layer.weight.numel() == 0 and layer.method.packed is not None
    assert layer.weight.dtype == torch.bfloat16  # the layer still reads as bfloat16


@pytest.mark.parametrize("bias", [True, False])
def test_float32_weight_packs_and_a_row_keeps_its_bits(bias):
    layer = Linear(40, 96, bias=bias)
    layer.bind_device(torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    layer.weight = torch.nn.Parameter(weight.clone(), False)
    if bias:
        layer.bias = torch.nn.Parameter(b.clone(), False)
    if not cpu_packs(layer.weight):
        pytest.skip("PyTorch here has no oneDNN")
    x = torch.randn(CPU_BF16_ROW_BUCKET + 5, 40, generator=gen)
    one = layer(x[:1])
    assert layer.weight.numel() == 0 and layer.method.packed is not None
    torch.testing.assert_close(one, F.linear(x[:1], weight, b), rtol=1e-5, atol=1e-5)
    for rows in (2, 5, 16, CPU_BF16_ROW_BUCKET + 5):  # a verify's rows, a prefill's
        many = layer(x[:rows])
        torch.testing.assert_close(many, F.linear(x[:rows], weight, b), rtol=1e-5, atol=1e-5)
        assert torch.equal(many[:1], one), rows


@pytest.mark.parametrize("rows", [1, 3, CPU_BF16_ROW_BUCKET + 5])
def test_tied_bfloat16_head_keeps_the_embedding_and_equals_f_linear(rows):
    embed = torch.nn.Embedding(300, 40).to(torch.bfloat16).requires_grad_(False)  # as loaded
    table = embed.weight.detach().clone()
    hidden = torch.randn(rows, 40).to(torch.bfloat16)
    out = torch.empty(rows, 300, dtype=torch.bfloat16)
    logits = head_logits(None, embed, hidden, out)
    assert torch.equal(logits, F.linear(hidden, table))
    assert torch.equal(out, logits)
    assert torch.equal(embed.weight, table)  # the lookups still read every row
    assert torch.equal(head_logits(None, embed, hidden), F.linear(hidden, table))


def test_tied_float32_head_keeps_the_embedding():
    embed = torch.nn.Embedding(300, 40).requires_grad_(False)
    table = embed.weight.detach().clone()
    hidden = torch.randn(3, 40)
    logits = head_logits(None, embed, hidden)
    torch.testing.assert_close(logits, F.linear(hidden, table), rtol=1e-5, atol=1e-5)
    assert torch.equal(embed.weight, table)  # the lookups still read every row
    assert torch.equal(head_logits(None, embed, hidden[:1]), logits[:1])


def test_bfloat16_without_onednn_kernels_takes_the_c_kernel(monkeypatch):
    # a CPU whose oneDNN has no bfloat16 kernels: bfloat16 reads, float32 products, one
    # rounding; a row's bits the same at every row count the kernel takes (a verify's);
    # more rows through a float32 copy
    from attention.cpu_paths import require_kernels

    import vllmpy.layers.quantization.dense as dense

    require_kernels()
    monkeypatch.setattr(dense, "_MKLDNN_BF16", False)
    layer, weight, b = bf16_layer(True, 9, k=64)
    assert dense.cpu_bf16_rows(layer.weight)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    exact = F.linear(x.float(), weight.float()) + b.float()
    one = layer(x[:1])
    for rows in (1, 2, 5, 16, 40):
        out = layer(x[:rows])
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), exact[:rows], rtol=2**-7, atol=1e-2)
        if rows <= 16:
            assert torch.equal(out[:1], one), rows
    assert layer.weight.shape == (96, 64)  # read in place, no copy kept


def test_tied_bfloat16_head_without_onednn_kernels(monkeypatch):
    from attention.cpu_paths import require_kernels

    import vllmpy.layers.quantization.dense as dense

    require_kernels()
    monkeypatch.setattr(dense, "_MKLDNN_BF16", False)
    embed = torch.nn.Embedding(300, 64).to(torch.bfloat16).requires_grad_(False)
    hidden = torch.randn(3, 64).to(torch.bfloat16)
    out = torch.empty(3, 300, dtype=torch.bfloat16)
    logits = head_logits(None, embed, hidden, out)
    assert logits.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.float(), F.linear(hidden.float(), embed.weight.float()),
                               rtol=2**-7, atol=1e-2)
