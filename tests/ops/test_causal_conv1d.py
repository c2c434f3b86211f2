"""The causal depthwise convolution with a carried window: the reference against
transformers' convolution of a whole sequence, and the Triton kernel (the interpreter on
the CPU) against the reference over mixed request lengths and chunks."""

from __future__ import annotations

import pytest
import torch

from vllmpy.ops.causal_conv1d import causal_conv1d, causal_conv1d_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHANNELS, TAPS = 24, 4


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CHANNELS, TAPS, generator=g), torch.randn(CHANNELS, generator=g)


def _x(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, CHANNELS, generator=torch.Generator().manual_seed(seed))


def _state(num_seats: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_seats + 1, CHANNELS, TAPS - 1, generator=g)


def test_reference_in_pieces_matches_transformers_whole_sequence():
    """A 10-token sequence from a zero window, fed as 2 + 1 + 7 tokens through one seat:
    transformers' zero-padded convolution of the whole sequence, then SiLU; the seat ends
    holding the last three inputs."""
    from transformers.models.mamba2 import modeling_mamba2 as hf

    w, b = _weights(0)
    x = _x(10, 1)
    expected = hf.causal_conv1d_fn(x.t()[None], w, b, activation="silu")[0].t()
    state = torch.zeros(2, CHANNELS, TAPS - 1)
    outs = [causal_conv1d_ref(x[lo:hi], w, b, state, [0, hi - lo], [1])
            for lo, hi in ((0, 2), (2, 3), (3, 10))]
    torch.testing.assert_close(torch.cat(outs), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[1], x[-3:].t())
    assert state[0].abs().sum() == 0


LAYOUTS = [([5, 1, 2, 0], [2, 0, 3, 4]), ([1, 1, 1], [1, 3, 0]), ([9], [2])]


@pytest.mark.parametrize("lengths,seats", LAYOUTS)
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_reference(lengths, seats, bias):
    """Requests shorter and longer than the window, decodes, an empty padding request on
    the scratch seat and padding rows past the last request."""
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    w, b = _weights(2)
    b = b if bias else None
    x = _x(qsl[-1] + 2, 3)
    ref_state = _state(4, 4)
    ref = causal_conv1d_ref(x, w, b, ref_state, qsl, seats)
    state = _state(4, 4).to(DEVICE)
    out = causal_conv1d(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE),
                        state, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                        torch.tensor(seats, dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.cpu(), ref_state)
    assert out[qsl[-1]:].abs().sum() == 0


def test_kernel_on_a_column_slice_without_silu():
    """x as a slice of a wider projection (its row stride is not its width)."""
    w, b = _weights(5)
    wide = torch.randn(6, CHANNELS + 10, generator=torch.Generator().manual_seed(6))
    x = wide[:, 3:3 + CHANNELS]
    ref_state = _state(2, 7)
    ref = causal_conv1d_ref(x, w, b, ref_state, [0, 4, 6], [2, 0], silu=False)
    state = _state(2, 7).to(DEVICE)
    out = causal_conv1d(wide.to(DEVICE)[:, 3:3 + CHANNELS], w.to(DEVICE), b.to(DEVICE),
                        state, torch.tensor([0, 4, 6], dtype=torch.int32, device=DEVICE),
                        torch.tensor([2, 0], dtype=torch.int32, device=DEVICE), silu=False)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.cpu(), ref_state)


def test_shapes_are_checked():
    w, b = _weights(8)
    with pytest.raises(ValueError, match="conv_state has shape"):
        causal_conv1d_ref(_x(3, 9), w, b, torch.zeros(2, CHANNELS, TAPS), [0, 3], [0])
    with pytest.raises(ValueError, match="at least 2 taps"):
        causal_conv1d_ref(_x(3, 9), w[:, :1], b, torch.zeros(2, CHANNELS, 0), [0, 3], [0])
