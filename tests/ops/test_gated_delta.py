"""The gated delta rule with its state carried in seats: the token-by-token reference
against transformers' recurrence and chunked form over whole sequences, the chunked PyTorch
form and the Triton kernels (the interpreter on the CPU) against the reference over mixed
request lengths, chunk boundaries, shared key heads and padding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllmpy.ops.gated_delta import (
    gated_delta_decode,
    gated_delta_prefill,
    gated_delta_rule_ref,
    gated_delta_rule_torch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, seed: int
            ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hk, dk, generator=g)
    k = torch.randn(tokens, hk, dk, generator=g)
    v = torch.randn(tokens, hv, dv, generator=g)
    # the layer's decay and write strength: -exp(A) * softplus(a), sigmoid(b)
    decay = -torch.rand(hv, generator=g) * F.softplus(torch.randn(tokens, hv, generator=g))
    beta = torch.sigmoid(torch.randn(tokens, hv, generator=g))
    return q, k, v, decay, beta


def _state(num_seats: int, hv: int, dk: int, dv: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.3 * torch.randn(num_seats + 1, hv, dk, dv, generator=g)


def _hf(q, k, v, g, beta, initial):
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    return hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=initial[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("hk,hv", [(2, 2), (1, 3)])
def test_reference_in_pieces_matches_transformers(hk, hv):
    """A 9-token sequence from a non-zero state fed as 4 + 1 + 4 tokens through one seat:
    transformers' recurrence over the whole sequence (outputs and final state), and its
    chunked form in chunks of 4."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta = _inputs(9, hk, hv, 8, 6, 0)
    state = _state(1, hv, 8, 6, 1)
    initial = state[0].clone()
    want, want_state = _hf(q, k, v, g, beta, initial)
    chunked, _ = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], chunk_size=4,
        initial_state=initial[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(chunked, want, atol=1e-5, rtol=1e-5)
    outs = [gated_delta_rule_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state,
                                 [0, hi - lo], [0]) for lo, hi in ((0, 4), (4, 5), (5, 9))]
    torch.testing.assert_close(torch.cat(outs), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0], want_state[0], atol=1e-5, rtol=1e-5)


# (request lengths, seats): decodes and prefills beside each other, a request across a
# chunk boundary (chunk 4: lengths 5, 9), an empty padding request on the scratch seat
LAYOUTS = [([5, 1, 9, 0, 2], [2, 0, 3, 4, 1]), ([1, 1, 1], [1, 3, 0]), ([4], [2])]


def _step(lengths: list[int], seats: list[int], hk: int, hv: int, seed: int):
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    inputs = _inputs(qsl[-1] + 2, hk, hv, 8, 12, seed)  # two padding rows past the last
    return qsl, inputs, _state(4, hv, 8, 12, seed + 1)


@pytest.mark.parametrize("lengths,seats", LAYOUTS)
def test_chunked_matches_reference(lengths, seats):
    qsl, inputs, state = _step(lengths, seats, 2, 4, 3)
    want_state = state.clone()
    want = gated_delta_rule_ref(*inputs, want_state, qsl, seats)
    got = gated_delta_rule_torch(*inputs, state, qsl, seats, chunk=4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)
    assert got[qsl[-1]:].abs().sum() == 0  # rows no request owns


@pytest.mark.parametrize("lengths,seats", LAYOUTS)
@pytest.mark.parametrize("hk,hv", [(2, 4), (3, 3)])
def test_prefill_kernel_matches_reference(lengths, seats, hk, hv):
    qsl, inputs, state = _step(lengths, seats, hk, hv, 5)
    want_state = state.clone()
    want = gated_delta_rule_ref(*inputs, want_state, qsl, seats)
    dev = [t.to(DEVICE) for t in inputs]
    got_state = state.to(DEVICE)
    got = gated_delta_prefill(*dev, got_state,
                              torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                              torch.tensor(seats, dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.cpu(), want_state, atol=1e-5, rtol=1e-5)


def test_decode_kernel_matches_reference_and_leaves_empty_seats():
    """One token per request, a padding request with no token: its seat is untouched."""
    lengths, seats = [1, 1, 0, 1], [3, 0, 4, 2]
    qsl, inputs, state = _step(lengths, seats, 1, 2, 7)
    want_state = state.clone()
    want = gated_delta_rule_ref(*inputs, want_state, qsl, seats)
    assert torch.equal(want_state[4], state[4]) and torch.equal(want_state[1], state[1])
    dev = [t.to(DEVICE) for t in inputs]
    got_state = state.to(DEVICE)
    got = gated_delta_decode(*dev, got_state,
                             torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                             torch.tensor(seats, dtype=torch.int32, device=DEVICE))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.cpu(), want_state, atol=1e-5, rtol=1e-5)


def test_kernel_keeps_a_bfloat16_state_in_float32_between_tokens():
    """A bfloat16 state and inputs: the kernel's output is the float32 reference's on the
    same rounded inputs within bfloat16's precision."""
    qsl, inputs, state = _step([6, 1], [1, 0], 2, 2, 9)
    inputs = tuple(t.bfloat16() for t in inputs)
    state = state.bfloat16()
    want_state = state.float()
    want = gated_delta_rule_ref(*(t.float() for t in inputs), want_state, qsl, [1, 0])
    got_state = state.to(DEVICE)
    got = gated_delta_prefill(*(t.to(DEVICE) for t in inputs), got_state,
                              torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                              torch.tensor([1, 0], dtype=torch.int32, device=DEVICE))
    assert got.dtype == torch.bfloat16 and got_state.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_state.cpu().float(), want_state, atol=2e-2, rtol=2e-2)


def test_shapes_are_checked():
    q, k, v, g, beta = _inputs(3, 2, 3, 8, 4, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        gated_delta_rule_ref(q, k, v, g, beta, _state(1, 3, 8, 4, 0), [0, 3], [0])
    q, k, v, g, beta = _inputs(3, 2, 4, 8, 4, 0)
    with pytest.raises(ValueError, match="state has shape"):
        gated_delta_rule_ref(q, k, v, g, beta, _state(1, 4, 4, 8, 0), [0, 3], [0])
