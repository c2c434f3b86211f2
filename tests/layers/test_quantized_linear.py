"""GGUF-quantized weights in the linear layers (the GGUF quantization method) on a CPU
without the C kernels (no compiler): kept 4-bit in bfloat16, exact dequantization where no
PyTorch kernel takes the type. With the C kernels every type runs in its blocks:
tests/ops/test_cpu_gguf.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from vllmpy.layers.linear import Linear, PackedLinear, describe_quantized_layers
from vllmpy.layers.quantization.gguf import GGUFLinearMethod, QuantizedTensor
from vllmpy.ops.cpu_int4 import BLOCK, int4_linear, pack_int4

TYPES = ("Q4_0", "Q4_1", "Q8_0")


@pytest.fixture(autouse=True)
def _without_c_kernels(monkeypatch):
    """The paths of a machine without the C kernels (``cpu_gguf`` takes every type)."""
    from attention.cpu_paths import use_torch_ops

    use_torch_ops(monkeypatch)
INT4 = ("Q4_0", "Q4_1")


def quantize(w: np.ndarray, qtype: str, dtype: torch.dtype = torch.float32) -> QuantizedTensor:
    """``w`` [rows, cols] through the gguf package's own quantizer."""
    raw = gguf.quants.quantize(w.astype(np.float32), QType[qtype])
    return QuantizedTensor(qtype, w.shape, torch.from_numpy(raw), dtype)


def reference(qtype: str, w: np.ndarray) -> torch.Tensor:
    """The gguf package's dequantization of ``w`` quantized as ``qtype``, float32."""
    raw = gguf.quants.quantize(w.astype(np.float32), QType[qtype])
    return torch.from_numpy(gguf.quants.dequantize(raw, QType[qtype]).copy())


def weights(rows: int, cols: int, seed: int) -> np.ndarray:
    # Rows of different scales and an offset, so that d and m vary from block to block.
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 0.2, (rows, 1))
    return (w + rng.uniform(-0.05, 0.05, (rows, 1))).astype(np.float32)


def gguf_linear(cols: int, rows: int, bias: bool = False) -> Linear:
    layer = Linear(cols, rows, bias)
    layer.set_method(GGUFLinearMethod())
    return layer


def kinds(layer: Linear) -> list[str]:
    return [seg.kind for seg in layer.method.segments]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_the_gguf_package_bit_for_bit(qtype):
    w = weights(48, 4 * BLOCK, seed=0)
    qt = quantize(w, qtype)
    assert torch.equal(qt.dense(), reference(qtype, w))
    # As a tensor it stands for its dequantized weights, in its own dtype.
    assert torch.equal(qt, reference(qtype, w))
    half = quantize(w, qtype, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and tuple(half.shape) == w.shape
    assert torch.equal(half.to(torch.float32), reference(qtype, w).bfloat16().float())


def test_int4_kernel_convention_and_packing():
    """aten's CPU 4-bit matmul computes x @ ((code - 8) * scale + zero)^T per group of 32:
    what pack_int4 relies on to map GGUF codes through unchanged."""
    torch.manual_seed(0)
    rows, cols = 64, 4 * BLOCK
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.int32)
    scale = torch.rand(rows, cols // BLOCK) + 0.5
    zero = torch.randn(rows, cols // BLOCK)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()
    x = torch.randn(3, cols).bfloat16()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, BLOCK, sz)
    s = sz[..., 0].float().t().repeat_interleave(BLOCK, 1)
    z = sz[..., 1].float().t().repeat_interleave(BLOCK, 1)
    expected = x.float() @ ((codes.float() - 8) * s + z).t()
    assert rel_err(out, expected) < 4e-3  # the bfloat16 output's rounding
    # Codes taken as they are, without the shift, would be far off.
    assert rel_err(out, x.float() @ (codes.float() * s + z).t()) > 0.1


@pytest.mark.parametrize("qtype", INT4)
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_int4_linear_matches_the_dequantized_matmul(qtype, num_tokens):
    w = weights(96, 6 * BLOCK, seed=1)
    qt = quantize(w, qtype, torch.bfloat16)
    layer = gguf_linear(w.shape[1], w.shape[0])
    layer.load_weight(qt, "w")
    assert kinds(layer) == ["int4"] and not hasattr(layer, "weight")
    x = torch.randn(num_tokens, w.shape[1]).bfloat16()
    exact = x.float() @ reference(qtype, w).t()
    err = rel_err(layer(x), exact)
    # Scales and zeros rounded to bfloat16, then the output: a few parts in a thousand;
    # the dense bfloat16 path (weights rounded to bfloat16) is in the same range.
    dense = torch.nn.functional.linear(x, reference(qtype, w).bfloat16())
    assert err < 1e-2, err
    assert err < 3 * rel_err(dense, exact) + 1e-3, (err, rel_err(dense, exact))


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_q8_0_in_two_4_bit_passes_matches_the_dequantized_matmul(num_tokens):
    w = weights(96, 6 * BLOCK, seed=5)
    qt = quantize(w, "Q8_0", torch.bfloat16)
    packed = pack_int4(qt.blocks, "Q8_0", w.shape[1], torch.bfloat16)
    assert len(packed.passes) == 2
    x = torch.randn(num_tokens, w.shape[1]).bfloat16()
    exact = x.float() @ reference("Q8_0", w).t()
    dense = torch.nn.functional.linear(x, reference("Q8_0", w).bfloat16())
    err = rel_err(int4_linear(x, packed), exact)
    assert err < 1e-2 and err < 3 * rel_err(dense, exact) + 1e-3, (err, rel_err(dense, exact))


def test_int4_scales_round_only_to_bfloat16():
    """With scales and zeros that bfloat16 holds exactly, the 4-bit path is the dequantized
    matmul up to the output's rounding."""
    w = weights(64, 4 * BLOCK, seed=2)
    qt = quantize(w, "Q4_1", torch.bfloat16)
    packed = pack_int4(qt.blocks, "Q4_1", w.shape[1], torch.bfloat16)
    (_, scales_zeros), = packed.passes
    s = scales_zeros[..., 0].float().t().repeat_interleave(BLOCK, 1)
    z = scales_zeros[..., 1].float().t().repeat_interleave(BLOCK, 1)
    codes = qt.dense(torch.float32)  # recover the codes from the exact weights
    d, m = _q4_1_scales(qt)
    codes = torch.round((codes - m) / d)
    assert codes.min() >= 0 and codes.max() <= 15
    x = torch.randn(4, w.shape[1]).bfloat16()
    expected = x.float() @ ((codes - 8) * s + z).t()
    assert rel_err(int4_linear(x, packed), expected) < 4e-3


def _q4_1_scales(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = tuple(qt.shape)
    blk = qt.blocks.view(rows, cols // BLOCK, 20)
    d = blk[..., 0:2].contiguous().view(torch.float16).float()
    m = blk[..., 2:4].contiguous().view(torch.float16).float()
    return (d.repeat_interleave(BLOCK, 1).reshape(rows, cols),
            m.repeat_interleave(BLOCK, 1).reshape(rows, cols))


# Q5_0: a type no CPU kernel takes
@pytest.mark.parametrize("dtype,qtype", [(torch.float32, "Q4_1"), (torch.float32, "Q5_0"),
                                         (torch.bfloat16, "Q5_0")])
def test_other_cases_dequantize_exactly(dtype, qtype):
    w = weights(32, 2 * BLOCK, seed=3)
    layer = gguf_linear(w.shape[1], w.shape[0])
    layer.load_weight(quantize(w, qtype, dtype), "w")
    assert kinds(layer) == ["dense"]
    assert torch.equal(layer.method.segments[0].weight, reference(qtype, w).to(dtype))


def test_rows_the_packer_cannot_take_are_dequantized():
    w = weights(40, 2 * BLOCK, seed=4)  # 40 rows: not a multiple of 16
    layer = gguf_linear(w.shape[1], w.shape[0])
    layer.load_weight(quantize(w, "Q4_0", torch.bfloat16), "w")
    assert kinds(layer) == ["dense"]
    assert torch.equal(layer.method.segments[0].weight, reference("Q4_0", w).bfloat16())


def qkv_layer(dtype: torch.dtype, bias: bool = False) -> PackedLinear:
    layer = PackedLinear(2 * BLOCK, {"q": 64, "k": 32, "v": 32}, bias=bias).to(dtype)
    layer.set_method(GGUFLinearMethod())
    return layer


def test_packed_shards_are_packed_together():
    ws = {s: weights(n, 2 * BLOCK, seed=i) for i, (s, n) in enumerate(
        (("q", 64), ("k", 32), ("v", 32)))}
    layer = qkv_layer(torch.bfloat16, bias=True)
    for shard, w in ws.items():
        layer.load_tensor("weight", quantize(w, "Q4_1", torch.bfloat16), shard, shard)
        layer.load_tensor("bias", torch.full((w.shape[0],), 1.0), shard, shard)
        assert (kinds(layer) == []) == (shard != "v")  # packed once the last shard is in
    assert kinds(layer) == ["int4"]
    x = torch.randn(3, 2 * BLOCK).bfloat16()
    exact = x.float() @ torch.cat([reference("Q4_1", w) for w in ws.values()]).t() + 1.0
    assert rel_err(layer(x), exact) < 1e-2


def test_packed_shards_of_mixed_types_run_side_by_side():
    """Q4_1 q and k pack together; a Q5_0 v has no CPU kernel and is dequantized
    into its own segment: one output, each segment's columns its own."""
    ws = {s: weights(n, 2 * BLOCK, seed=i) for i, (s, n) in enumerate(
        (("q", 64), ("k", 32), ("v", 32)))}
    types = {"q": "Q4_1", "k": "Q4_1", "v": "Q5_0"}
    layer = qkv_layer(torch.bfloat16)
    for shard, w in ws.items():
        layer.load_tensor("weight", quantize(w, types[shard], torch.bfloat16), shard, shard)
    assert kinds(layer) == ["int4", "dense"]
    assert [(seg.offset, seg.rows) for seg in layer.method.segments] == [(0, 96), (96, 32)]
    assert torch.equal(layer.method.segments[1].weight, reference("Q5_0", ws["v"]).bfloat16())
    x = torch.randn(3, 2 * BLOCK).bfloat16()
    exact = x.float() @ torch.cat([reference(types[s], w) for s, w in ws.items()]).t()
    assert rel_err(layer(x), exact) < 1e-2
    assert describe_quantized_layers(layer) == (
        "quantized linear weights: 1 Q4_1+Q5_0 layer(s) run 4-bit (CPU int4 matmul, "
        "bfloat16) and dequantized to bfloat16")


def test_a_shard_loaded_twice_is_refused():
    layer = qkv_layer(torch.bfloat16)
    for shard, n in (("q", 64), ("k", 32), ("v", 32)):
        layer.load_tensor("weight", quantize(weights(n, 64, 0), "Q4_0", torch.bfloat16),
                          shard, shard)
    with pytest.raises(ValueError, match="k_proj.weight: loaded twice"):
        layer.load_tensor("weight", quantize(weights(32, 64, 0), "Q4_0", torch.bfloat16),
                          "k", "model.k_proj.weight")


def test_shape_mismatch_is_refused_by_name():
    layer = gguf_linear(64, 32)
    with pytest.raises(ValueError, match=r"weight o_proj\.weight: checkpoint shape \(16, 64\)"):
        layer.load_weight(quantize(weights(16, 64, 0), "Q4_1", torch.bfloat16),
                          "o_proj.weight")


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="'Q1_0'"):
        QuantizedTensor("Q1_0", (4, 32), torch.zeros(4, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match="blocks of 256 along its 32 columns"):
        QuantizedTensor("Q4_K", (4, 32), torch.zeros(4, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match="blocks of 32 along its 48 columns"):
        QuantizedTensor("Q4_0", (4, 48), torch.zeros(4, 27, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"must be uint8 \(4, 18\)"):
        QuantizedTensor("Q4_0", (4, 32), torch.zeros(4, 20, dtype=torch.uint8))


def test_the_start_up_line_names_the_path():
    model = torch.nn.ModuleList([gguf_linear(64, 32), gguf_linear(64, 32), Linear(64, 32)])
    model = model.to(torch.bfloat16)
    model[0].load_weight(quantize(weights(32, 64, 0), "Q4_1", torch.bfloat16))
    model[1].load_weight(quantize(weights(32, 64, 1), "Q5_0", torch.bfloat16))
    model[2].load_weight(torch.zeros(32, 64))
    assert describe_quantized_layers(model) == (
        "quantized linear weights: 1 Q4_1 layer(s) run 4-bit (CPU int4 matmul, bfloat16); "
        "1 Q5_0 layer(s) dequantized to bfloat16")
    assert describe_quantized_layers(torch.nn.ModuleList([Linear(4, 4)])) is None
