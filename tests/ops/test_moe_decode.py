"""The one-row decode kernels of the MoE experts against the layer's PyTorch reference
(under Triton's interpreter on the CPU): random routings, repeated experts across tokens,
biases and the clamped SwiGLU, sizes that are no multiple of the tiles."""

from __future__ import annotations

import pytest
import torch

from vllmpy.layers.moe import moe_reference, select_experts
from vllmpy.ops.moe_decode import moe_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(e: int, h: int, i: int, tokens: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    x = rnd(tokens, h, scale=1.0)
    weights, ids = select_experts(torch.randn(tokens, e, generator=g), k, True)
    return x, rnd(e, 2 * i, h), rnd(e, h, i), rnd(e, 2 * i), rnd(e, h), \
        weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("tokens,k,e", [(1, 8, 16), (3, 2, 4), (8, 4, 5)])
def test_matches_reference(tokens: int, k: int, e: int) -> None:
    x, w13, w2, _, _, weights, ids = _case(e, 80, 40, tokens, k, torch.float32, tokens)
    ours = moe_decode(x, w13, w2, weights, ids, block_n=(16, 16), block_k=32)
    torch.testing.assert_close(ours, moe_reference(x, w13, w2, weights, ids),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_biases_and_activations(activation: str) -> None:
    x, w13, w2, b13, b2, weights, ids = _case(6, 48, 24, 4, 2, torch.float32, 9)
    args = dict(activation=activation, alpha=1.702, limit=0.5)
    ours = moe_decode(x, w13, w2, weights, ids, b13, b2, **args, block_k=32)
    ref = moe_reference(x, w13, w2, weights, ids, b13, b2, **args)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_bfloat16() -> None:
    """bf16 weights and rows; the sum over a token's experts is fp32, rounded once."""
    x, w13, w2, _, _, weights, ids = _case(8, 64, 32, 2, 4, torch.bfloat16, 3)
    ours = moe_decode(x, w13, w2, weights, ids, block_k=64)
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref, rtol=2e-2, atol=2e-2)


def _fp8_experts(e: int, rows: int, cols: int, block: tuple[int, int] | None, seed: int):
    """Codes and scales of random [e, rows, cols] weights, per tensor ([e, 1, 1]) or per
    block; and the weights they stand for (codes times their expanded scales)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, rows, cols, generator=g) * 0.3
    bn, bk = block if block is not None else (rows, cols)
    nr, nc = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(e, nr * bn, nc * bk)
    padded[:, :rows, :cols] = w
    amax = padded.view(e, nr, bn, nc, bk).abs().amax(dim=(2, 4)).clamp(min=1e-6)
    scale = amax / 448.0
    expanded = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :rows, :cols]
    codes = (w / expanded).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * expanded


@pytest.mark.parametrize("block", [None, (128, 128), (32, 64)])
def test_fp8_experts_match_their_dequantized_weights(block) -> None:
    from vllmpy.ops.fused_moe import fused_moe

    e, h, i, tokens, k = 5, 200, 136, 3, 2
    gate, s_gate, d_gate = _fp8_experts(e, i, h, block, 1)
    up, s_up, d_up = _fp8_experts(e, i, h, block, 2)
    down, s_down, d_down = _fp8_experts(e, h, i, block, 3)
    w13 = torch.cat((gate, up), dim=1).to(DEVICE)
    if block is None:  # per tensor: [E, 2] (gate, up) and [E]
        s13, s2 = torch.cat((s_gate, s_up), dim=1).reshape(e, 2), s_down.reshape(e)
    else:
        s13, s2 = torch.cat((s_gate, s_up), dim=1), s_down
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, h, generator=g)
    weights, ids = select_experts(torch.randn(tokens, e, generator=g), k, True)
    ours = fused_moe(x.to(DEVICE), w13, down.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE),
                     w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE), scale_block=block,
                     rows=True)
    ref = moe_reference(x, torch.cat((d_gate, d_up), dim=1), d_down, weights, ids)
    torch.testing.assert_close(ours.cpu(), ref, rtol=1e-4, atol=1e-4)
