"""The Mamba2 recurrence: the token-by-token reference against transformers' chunked scan,
and the chunked PyTorch scan and the Triton kernels (the interpreter on the CPU) against
the reference, over mixed request lengths, seats carried across chunks and padding."""

from __future__ import annotations

import math

import pytest
import torch

from vllmpy.ops.mamba_ssd import (
    discretize_dt,
    ssd_chunked,
    ssd_decode,
    ssd_prefill,
    ssd_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, HEAD_DIM, GROUPS, D_STATE = 4, 8, 2, 16


def _inputs(tokens: int, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return dict(x=rand(tokens, HEADS, HEAD_DIM), dt=rand(tokens, HEADS),
                A=-torch.exp(rand(HEADS, scale=0.5)), B=rand(tokens, GROUPS, D_STATE),
                C=rand(tokens, GROUPS, D_STATE), D=rand(HEADS), dt_bias=rand(HEADS))


def _states(num_seats: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_seats + 1, HEADS, HEAD_DIM, D_STATE, generator=g).to(device)


def test_reference_matches_transformers_chunked_scan():
    """One request from a nonzero state, its dt clamped: transformers' own torch scan (the
    chunk form its Mamba2 layers run on a prompt) gives the same outputs and final state."""
    from transformers.models.mamba2 import modeling_mamba2 as hf

    n = 23
    inp = _inputs(n, 0)
    state = _states(1, 1)
    init = state[0].clone()
    limit = (0.05, 2.0)
    y = ssd_reference(**inp, state=state, query_start_loc=[0, n], seats=[0], dt_limit=limit)
    hf_y, hf_state = hf.mamba2_chunk_scan(
        inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None], inp["C"][None],
        chunk_size=8, D=inp["D"], dt_bias=inp["dt_bias"], initial_states=init[None],
        dt_softplus=True, dt_limit=limit, return_final_states=True)
    torch.testing.assert_close(y, hf_y[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[0], hf_state[0], atol=1e-4, rtol=1e-4)


def test_discretize_clamps_after_softplus():
    dt = torch.tensor([[-30.0, 0.0, 30.0]])
    out = discretize_dt(dt, torch.zeros(3), (0.1, 5.0))
    torch.testing.assert_close(out, torch.tensor([[0.1, math.log(2.0), 5.0]]))


# (query lengths, seats) of a step: a 70-token prompt crosses the 64-token chunk, a
# one-token decode, an empty padding request on the scratch seat, and padding rows after
LAYOUTS = [([5, 70, 1, 0], [2, 0, 3, 4]), ([1, 1, 1], [1, 3, 0]), ([9], [2])]


def _step(lengths: list[int], pad_rows: int = 3) -> tuple[list[int], int]:
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return qsl, qsl[-1] + pad_rows


@pytest.mark.parametrize("lengths,seats", LAYOUTS)
def test_chunked_scan_matches_reference(lengths, seats):
    qsl, tokens = _step(lengths)
    inp = _inputs(tokens, 2)
    ref_state, state = _states(4, 3), _states(4, 3)
    ref = ssd_reference(**inp, state=ref_state, query_start_loc=qsl, seats=seats,
                        dt_limit=(0.0, 3.0))
    out = ssd_chunked(**inp, state=state, query_start_loc=qsl, seats=seats,
                      dt_limit=(0.0, 3.0), chunk=16)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)
    assert out[qsl[-1]:].abs().sum() == 0  # padding rows


def _device_args(qsl: list[int], seats: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            torch.tensor(seats, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("lengths,seats", LAYOUTS)
def test_prefill_kernel_matches_reference(lengths, seats):
    qsl, tokens = _step(lengths)
    inp = _inputs(tokens, 4)
    ref_state = _states(4, 5)
    ref = ssd_reference(**inp, state=ref_state, query_start_loc=qsl, seats=seats)
    state = _states(4, 5).to(DEVICE)
    out = ssd_prefill(**{k: v.to(DEVICE) for k, v in inp.items()}, state=state,
                      query_start_loc=_device_args(qsl, seats)[0],
                      seats=_device_args(qsl, seats)[1])
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.cpu(), ref_state, atol=1e-4, rtol=1e-4)


def test_kernels_carry_the_state_across_chunks():
    """A 12-token request as a 7-token prefill chunk, a 5-token chunk and two decode steps
    (from the seat the earlier launches left) equals the reference over all 14 tokens;
    the other seats are untouched."""
    n = 14
    inp = _inputs(n, 6)
    ref_state = _states(3, 7)
    ref = ssd_reference(**inp, state=ref_state, query_start_loc=[0, n], seats=[1],
                        dt_limit=(0.01, math.inf))
    state = _states(3, 7).to(DEVICE)
    untouched = state[[0, 2, 3]].clone()
    outs = []
    for lo, hi in ((0, 7), (7, 12), (12, 13), (13, 14)):
        part = {k: (v[lo:hi] if v.shape[0] == n and k not in ("A", "D", "dt_bias") else v)
                for k, v in inp.items()}
        part = {k: v.to(DEVICE) for k, v in part.items()}
        qsl, seats = _device_args([0, hi - lo], [1])
        run = ssd_decode if hi - lo == 1 else ssd_prefill
        outs.append(run(**part, state=state, query_start_loc=qsl, seats=seats,
                        dt_limit=(0.01, math.inf)).cpu())
    torch.testing.assert_close(torch.cat(outs), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[1].cpu(), ref_state[1], atol=1e-4, rtol=1e-4)
    assert torch.equal(state[[0, 2, 3]], untouched)


def test_decode_kernel_on_strided_slices_and_bf16_state():
    """A batch of decodes whose x, dt, B and C are column slices of one projection (as the
    layer passes them) and a bfloat16 state: the reference's values, rounded once."""
    reqs = 5
    inp = _inputs(reqs, 8)
    widths = [HEADS * HEAD_DIM, HEADS, GROUPS * D_STATE, GROUPS * D_STATE]
    packed = torch.cat([inp["x"].reshape(reqs, -1), inp["dt"], inp["B"].reshape(reqs, -1),
                        inp["C"].reshape(reqs, -1)], dim=1).to(DEVICE)
    x, dt, B, C = packed.split(widths, dim=1)
    seats = [4, 0, 2, 1, 5]
    ref_state = _states(5, 9).to(torch.bfloat16)
    ref = ssd_reference(**inp, state=ref_state, query_start_loc=list(range(reqs + 1)),
                        seats=seats)
    state = _states(5, 9).to(torch.bfloat16).to(DEVICE)
    qsl, seat_t = _device_args(list(range(reqs + 1)), seats)
    out = ssd_decode(x.view(reqs, HEADS, HEAD_DIM), dt, inp["A"].to(DEVICE),
                     B.view(reqs, GROUPS, D_STATE), C.view(reqs, GROUPS, D_STATE),
                     inp["D"].to(DEVICE), inp["dt_bias"].to(DEVICE), state, qsl, seat_t)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.cpu().float(), ref_state.float(), atol=1e-2, rtol=1e-2)


def test_bf16_inputs_give_float32_y_when_asked():
    """bfloat16 x, B, C and state with ``out_dtype=float32`` (as the Mamba2 mixer asks):
    every path returns the float32 reference of the same inputs, not its bf16 rounding."""
    lengths, seats = [5, 1, 3], [2, 0, 3]
    qsl, tokens = _step(lengths)
    inp = {k: v.to(torch.bfloat16) if k in ("x", "B", "C") else v
           for k, v in _inputs(tokens, 12).items()}
    ref_state = _states(4, 13).to(torch.bfloat16)
    ref = ssd_reference(**inp, state=ref_state, query_start_loc=qsl, seats=seats,
                        out_dtype=torch.float32)
    assert ref.dtype == torch.float32
    state = _states(4, 13).to(torch.bfloat16)
    chunked = ssd_chunked(**inp, state=state, query_start_loc=qsl, seats=seats, chunk=2,
                          out_dtype=torch.float32)
    state = _states(4, 13).to(torch.bfloat16).to(DEVICE)
    qsl_t, seats_t = _device_args(qsl, seats)
    kernel = ssd_prefill(**{k: v.to(DEVICE) for k, v in inp.items()}, state=state,
                         query_start_loc=qsl_t, seats=seats_t, out_dtype=torch.float32)
    one = {k: (v[:1] if v.shape[0] == tokens and k not in ("A", "D", "dt_bias") else v)
           for k, v in inp.items()}
    decode = ssd_decode(**{k: v.to(DEVICE) for k, v in one.items()},
                        state=_states(4, 13).to(torch.bfloat16).to(DEVICE),
                        query_start_loc=_device_args([0, 1], [2])[0],
                        seats=_device_args([0, 1], [2])[1], out_dtype=torch.float32)
    for out in (chunked, kernel.cpu(), decode.cpu()):
        assert out.dtype == torch.float32
    torch.testing.assert_close(chunked, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kernel.cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode.cpu(), ref[:1], atol=1e-4, rtol=1e-4)
    # the default keeps x's dtype: the same values, rounded once
    rounded = ssd_reference(**inp, state=_states(4, 13).to(torch.bfloat16),
                            query_start_loc=qsl, seats=seats)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, ref.to(torch.bfloat16))


def test_launcher_refuses_bad_shapes():
    inp = _inputs(4, 10)
    state = _states(2, 11)
    qsl, seats = _device_args([0, 4], [0])
    with pytest.raises(ValueError, match="state has shape"):
        ssd_prefill(**inp, state=state[..., :8], query_start_loc=qsl.cpu(), seats=seats.cpu())
    with pytest.raises(ValueError, match="query_start_loc has 3 entries"):
        ssd_prefill(**inp, state=state, query_start_loc=torch.tensor([0, 2, 4]),
                    seats=torch.tensor([0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_at_model_sizes_on_cuda(dtype):
    """Nemotron-H-like heads (64 heads of 64 rows, 8 groups, d_state 128) over prompts of
    up to 300 tokens and decodes: the chunked scan's values (itself checked against the
    reference above), in the inputs' dtype."""
    g = torch.Generator().manual_seed(12)
    heads, head_dim, groups, d_state = 64, 64, 8, 128
    lengths, seats = [300, 1, 77, 1, 129], [3, 0, 5, 1, 2]
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    t = qsl[-1]

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    inp = dict(x=rand(t, heads, head_dim), dt=rand(t, heads), A=-torch.exp(torch.randn(
        heads, generator=g)), B=rand(t, groups, d_state, scale=0.3),
        C=rand(t, groups, d_state, scale=0.3), D=torch.randn(heads, generator=g),
        dt_bias=torch.randn(heads, generator=g))
    state = torch.randn(6, heads, head_dim, d_state, generator=g).to(dtype)
    ref_state = state.clone()
    ref = ssd_chunked(**inp, state=ref_state, query_start_loc=qsl, seats=seats)
    state = state.cuda()
    qsl_t, seats_t = (torch.tensor(v, dtype=torch.int32, device="cuda") for v in (qsl, seats))
    out = ssd_prefill(**{k: v.cuda() for k, v in inp.items()}, state=state,
                      query_start_loc=qsl_t, seats=seats_t)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(state.cpu().float(), ref_state.float(), atol=tol, rtol=tol)
