"""The CPU's GGUF block kernel (csrc/gguf_blocks.c) against gguf-py's dequantization: every
block type (and dense bfloat16 rows, gguf-py's BF16), every row count (the fused few-row
path and the decoded-row path), float32 and bfloat16 activations, strided outputs; the
layers and tied heads that take it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from attention.cpu_paths import require_kernels
from gguf import GGMLQuantizationType as QType

from vllmpy.layers.linear import Linear, PackedLinear, describe_quantized_layers
from vllmpy.layers.quantization.gguf import GGUFLinearMethod, QuantizedTensor, tied_head
from vllmpy.ops import cpu_gguf

# every type the kernel reads (BF16: dense bfloat16 rows, gguf-py's BF16 type); the layers
# keep the GGUF block types in blocks
TYPES = sorted(cpu_gguf.QTYPE_CODES)
BLOCK_TYPES = [t for t in TYPES if t != "BF16"]


@pytest.fixture(autouse=True)
def _kernels():
    require_kernels()


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Blocks of ``qtype``: gguf-py's quantizer where it has one, else random codes under
    small finite scales (gguf-py quantizes no k-quant), so every bit of a code is used."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.02, 0.3, (rows, 1))).astype(
        np.float32)
    try:
        return torch.from_numpy(gguf.quants.quantize(w, QType[qtype]))
    except NotImplementedError:
        pass
    per, nbytes = gguf.GGML_QUANT_SIZES[QType[qtype]]
    raw = rng.integers(0, 256, (rows, cols // per, nbytes), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.02, (rows, cols // per, 2)).astype(np.float16)
    if qtype == "Q6_K":  # d last
        raw[..., 208:210] = halves[..., :1].view(np.uint8)
    else:  # d (and dmin) first
        raw[..., 0:4] = halves.view(np.uint8).reshape(rows, cols // per, 4)
    return torch.from_numpy(raw.reshape(rows, -1))


def reference(blocks: torch.Tensor, qtype: str, rows: int, cols: int) -> torch.Tensor:
    """gguf-py's dequantization, float64."""
    array = gguf.quants.dequantize(blocks.numpy(), QType[qtype]).reshape(rows, cols)
    return torch.from_numpy(array.astype(np.float64))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_gguf_py_bit_for_bit(qtype):
    rows, cols = 24, 512
    blocks = random_blocks(qtype, rows, cols, seed=1)
    w = cpu_gguf.make(blocks, qtype, rows, cols)
    assert torch.equal(cpu_gguf.dequantize(w, torch.float32).double(),
                       reference(blocks, qtype, rows, cols))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16, 17])
def test_linear_matches_the_dequantized_matmul(qtype, m):
    rows, cols = 40, 768
    blocks = random_blocks(qtype, rows, cols, seed=2)
    w = cpu_gguf.make(blocks, qtype, rows, cols)
    x = torch.randn(m, cols)
    exact = x.double() @ reference(blocks, qtype, rows, cols).t()
    assert rel_err(cpu_gguf.linear(x, w), exact) < 2e-6  # float32 sums in another order
    # bfloat16 activations: the output's rounding (the kernel computes in float32)
    y = cpu_gguf.linear(x.bfloat16(), w)
    assert y.dtype == torch.bfloat16
    exact16 = x.bfloat16().double() @ reference(blocks, qtype, rows, cols).t()
    assert rel_err(y, exact16) < 8e-3


def test_strided_rows_in_and_out():
    """A column slice of a wider output (a packed layer's segment) and rows of x with a
    stride: only the slice is written."""
    rows, cols = 32, 256
    blocks = random_blocks("Q4_K", rows, cols, seed=3)
    w = cpu_gguf.make(blocks, "Q4_K", rows, cols)
    x = torch.randn(3, 2 * cols)[:, :cols]  # rows 2 * cols apart
    out = torch.full((3, 100), 7.0)
    cpu_gguf.linear(x, w, out[:, 50:50 + rows])
    exact = x.double() @ reference(blocks, "Q4_K", rows, cols).t()
    assert rel_err(out[:, 50:50 + rows], exact) < 2e-6
    assert torch.equal(out[:, :50], torch.full((3, 50), 7.0))
    assert torch.equal(out[:, 50 + rows:], torch.full((3, 100 - 50 - rows), 7.0))


def test_one_kernel_per_row_count_is_the_same_per_row():
    """A row's output does not depend on how many rows share the call (four-row tiles,
    the single-row path, the decoded-row path): what a speculative verify relies on to
    score its drafts as one-token decodes would."""
    rows, cols = 48, 512
    w = cpu_gguf.make(random_blocks("Q6_K", rows, cols, seed=4), "Q6_K", rows, cols)
    x = torch.randn(9, cols)
    alone = torch.cat([cpu_gguf.linear(x[i:i + 1], w) for i in range(9)])
    for m in (2, 3, 4, 5, 9):
        together = cpu_gguf.linear(x[:m], w)
        assert torch.equal(together, alone[:m])


def layer_of(qtype: str, rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> Linear:
    blocks = random_blocks(qtype, rows, cols, seed)
    layer = Linear(cols, rows).to(dtype)
    layer.set_method(GGUFLinearMethod())
    layer.load_weight(QuantizedTensor(qtype, (rows, cols), blocks, dtype), "w")
    return layer


def test_in_float32_every_type_stays_in_its_blocks_in_a_layer():
    for qtype in BLOCK_TYPES:
        layer = layer_of(qtype, 32, 256, torch.float32)
        assert [s.kind for s in layer.method.segments] == ["cpu_blocks"]
        seg = layer.method.segments[0]
        assert seg.weight.nbytes == seg.weight.blocks.numel()  # no dense copy beside
    assert describe_quantized_layers(layer_of("Q4_1", 32, 256, torch.float32)) == (
        "quantized linear weights: 1 Q4_1 layer(s) kept in GGUF blocks (CPU C kernel, "
        "float32)")


def test_in_bfloat16_pytorchs_4_bit_kernels_keep_their_types_and_the_blocks_the_rest():
    expected = {"Q4_0": "int4", "Q4_1": "int4", "Q5_0": "cpu_blocks", "Q5_1": "cpu_blocks"}
    for qtype, kind in expected.items():
        layer = layer_of(qtype, 32, 256, torch.bfloat16)
        assert [s.kind for s in layer.method.segments] == [kind], qtype
    x = torch.randn(3, 256).bfloat16()
    layer = layer_of("Q5_1", 32, 256, torch.bfloat16, seed=9)
    blocks = layer.method.segments[0].weight.blocks
    exact = x.double() @ reference(blocks, "Q5_1", 32, 256).t()
    assert rel_err(layer(x), exact) < 8e-3


def test_packed_shards_of_mixed_types_write_their_own_columns():
    cols = 256
    shards = {"q": ("Q4_K", 64), "k": ("Q4_K", 32), "v": ("Q6_K", 32)}
    layer = PackedLinear(cols, {s: n for s, (_, n) in shards.items()})
    layer.set_method(GGUFLinearMethod())
    dense = []
    for i, (shard, (qtype, n)) in enumerate(shards.items()):
        blocks = random_blocks(qtype, n, cols, seed=10 + i)
        layer.load_tensor("weight", QuantizedTensor(qtype, (n, cols), blocks), shard, shard)
        dense.append(reference(blocks, qtype, n, cols))
    assert [(s.kind, s.quant_type, s.offset, s.rows) for s in layer.method.segments] == [
        ("cpu_blocks", "Q4_K", 0, 96), ("cpu_blocks", "Q6_K", 96, 32)]
    for m in (1, 3, 20):
        x = torch.randn(m, cols)
        assert rel_err(layer(x), x.double() @ torch.cat(dense).t()) < 2e-6


def test_a_tied_float32_head_runs_on_the_embeddings_blocks_and_the_dense_table_above():
    vocab, hidden = 96, 64
    blocks = random_blocks("Q8_0", vocab, hidden, seed=5)
    table = reference(blocks, "Q8_0", vocab, hidden).float()
    embed = torch.nn.Embedding(vocab, hidden).requires_grad_(False)
    embed.weight.copy_(table)
    head = tied_head(embed, QuantizedTensor("Q8_0", (vocab, hidden), blocks))
    assert head is not None and head.method.segments[0].kind == "cpu_blocks"
    assert head.method.dense_beside is embed.weight
    for m in (1, cpu_gguf.MAX_KERNEL_ROWS, cpu_gguf.MAX_KERNEL_ROWS + 1):
        x = torch.randn(m, hidden)
        assert rel_err(head(x), x.double() @ table.double().t()) < 2e-6
    assert "up to 16 tokens, dense float32 above" in describe_quantized_layers(head)
