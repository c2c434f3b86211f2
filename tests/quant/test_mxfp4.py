"""MXFP4 decoding against transformers' own (random bytes, every nibble and a wide range
of exponents), and the pairing of blocks with scales."""

from __future__ import annotations

import pytest
import torch

from vllmpy.layers.quantization.base import QuantizationError
from vllmpy.layers.quantization.mxfp4 import dequantize_mxfp4, dequantize_pairs


def test_decoding_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 10, 4), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 10]
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [3, 10, 128]
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2).bfloat16())


def test_pairs_and_refusals() -> None:
    blocks = torch.full((2, 1, 16), 0x21, dtype=torch.uint8)  # nibbles 1 (0.5) then 2 (1.0)
    scales = torch.full((2, 1), 128, dtype=torch.uint8)  # 2 ** 1
    out = dict(dequantize_pairs([("a.w_scales", scales), ("b", torch.ones(1)),
                                 ("a.w_blocks", blocks)], torch.float32))
    assert list(out) == ["b", "a.w"]
    assert out["a.w"].shape == (2, 32) and out["a.w"][0, :2].tolist() == [1.0, 2.0]
    with pytest.raises(QuantizationError, match="without their other half"):
        list(dequantize_pairs([("a.w_blocks", blocks)], torch.float32))
    with pytest.raises(QuantizationError, match="do not match scales"):
        dequantize_mxfp4(blocks, scales[:1])
    with pytest.raises(QuantizationError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales)
