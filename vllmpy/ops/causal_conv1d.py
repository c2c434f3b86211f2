"""The causal depthwise convolution of Mamba layers over a step's requests, with each
request's convolution window carried between steps: a PyTorch reference and a Triton
kernel.

Channel c of token t is ``bias[c] + sum_k weight[c, k] * u[t - (K-1) + k, c]`` over the
request's inputs u, a kernel of K taps, then SiLU (when asked). The K - 1 inputs before
the request's first token of the step come from its seat of ``conv_state``
[num_seats + 1, C, K - 1] (column 0 the oldest; zeros for a request that starts, the causal
zero padding), and the seat is left holding the request's last K - 1 inputs.

Request r owns rows ``query_start_loc[r]:query_start_loc[r+1]`` and seat ``seats[r]``;
rows no request owns come out as zeros; a request with an empty range leaves its seat.

The kernel takes one program per (request, block of channels): it walks the request's
tokens, reading each window from the step's inputs and, before the first token, from the
seat; then it writes the new window. It reads the step's layout from the device only, so
it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    channels, taps = weight.shape
    if x.dim() != 2 or x.shape[1] != channels:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [num_tokens, {channels}]")
    if taps < 2:
        raise ValueError(f"the convolution needs at least 2 taps, got {taps}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (channels, taps - 1):
        raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, expected "
                         f"[num_seats + 1, {channels}, {taps - 1}]")


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor, query_start_loc: list[int],
                      seats: list[int], silu: bool = True) -> torch.Tensor:
    """x [T, C], weight [C, K], bias [C] or None; ``conv_state`` is read and written at
    ``seats``. Returns [T, C] in x's dtype, computed in float32. Requests of one token are
    taken together; longer ones one by one (``F.conv1d``)."""
    _check(x, weight, conv_state)
    taps = weight.shape[1]
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    w = weight.float()
    b = None if bias is None else bias.float()
    singles = [r for r in range(len(seats))
               if query_start_loc[r + 1] - query_start_loc[r] == 1]
    if singles:
        rows = torch.tensor([query_start_loc[r] for r in singles], device=x.device)
        where = torch.tensor([seats[r] for r in singles], device=x.device)
        window = torch.cat([conv_state[where], x[rows, :, None]], dim=-1)  # [R, C, K]
        y = (window.float() * w).sum(-1)
        out[rows] = _finish(y, b, silu).to(out.dtype)
        conv_state[where] = window[..., 1:]
    for r, seat in enumerate(seats):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if end - start < 2:
            continue
        window = torch.cat([conv_state[seat], x[start:end].t()], dim=-1)  # [C, K-1+L]
        y = F.conv1d(window.float()[None], w[:, None, :], groups=w.shape[0])[0]  # [C, L]
        out[start:end] = _finish(y.t(), b, silu).to(out.dtype)
        conv_state[seat] = window[:, -(taps - 1):]
    return out


def _finish(y: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    if bias is not None:
        y = y + bias
    return F.silu(y) if silu else y


@triton.jit
def _window(x_ptr, state_ptr, start, rel, offs_c, mask_c, offs_k, mask_k, stride_xt,
            stride_sc, stride_sk, K: tl.constexpr):
    """The [BLOCK_C, BLOCK_K] inputs at request positions rel - (K-1) + k: from the step's
    rows where that is >= 0, else from the seat (``state_ptr`` at the seat)."""
    src = rel - (K - 1) + offs_k
    in_x = src >= 0
    rows = (start + src).to(tl.int64)
    from_x = tl.load(x_ptr + rows[None, :] * stride_xt + offs_c[:, None],
                     mask=mask_c[:, None] & (mask_k & in_x)[None, :], other=0.0)
    from_state = tl.load(state_ptr + offs_c[:, None] * stride_sc
                         + (K - 1 + src)[None, :] * stride_sk,
                         mask=mask_c[:, None] & (mask_k & (src < 0))[None, :], other=0.0)
    return from_x.to(tl.float32) + from_state.to(tl.float32)


@triton.jit
def _conv1d_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, seat_ptr,
                   stride_xt, stride_wc, stride_ss, stride_sc, stride_sk, stride_ot,
                   channels, K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    req = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < channels
    offs_k = tl.arange(0, BLOCK_K)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    if end > start:
        seat_state = state_ptr + tl.load(seat_ptr + req).to(tl.int64) * stride_ss
        taps = offs_k < K
        w = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_k[None, :],
                    mask=mask_c[:, None] & taps[None, :], other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros([BLOCK_C], dtype=tl.float32)
        for i in range(0, end - start):
            window = _window(x_ptr, seat_state, start, i, offs_c, mask_c, offs_k,
                             taps, stride_xt, stride_sc, stride_sk, K)
            y = tl.sum(w * window, axis=1) + bias
            if SILU:
                y = y * tl.sigmoid(y)
            tl.store(out_ptr + (start + i).to(tl.int64) * stride_ot + offs_c,
                     y.to(out_ptr.dtype.element_ty), mask=mask_c)
        # the new window: the last K - 1 inputs, shifted in from the step's rows; every
        # read of the old one is done before any write
        keep = offs_k < K - 1
        new = _window(x_ptr, seat_state, start, end - start,
                      offs_c, mask_c, offs_k, keep, stride_xt, stride_sc, stride_sk, K)
        tl.debug_barrier()
        tl.store(seat_state + offs_c[:, None] * stride_sc + offs_k[None, :] * stride_sk,
                 new.to(state_ptr.dtype.element_ty), mask=mask_c[:, None] & keep[None, :])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                  seats: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """``causal_conv1d_ref`` on the device: query_start_loc [R + 1] and seats [R] int32
    device tensors; x's channels and weight's taps contiguous."""
    _check(x, weight, conv_state)
    for name, t in (("x", x), ("conv_state", conv_state)):
        check_float(name, t, "convolution kernel")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x must be contiguous along its channels and weight along its taps")
    num_reqs = seats.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for "
                         f"{num_reqs} requests (expected {num_reqs + 1})")
    channels, taps = weight.shape
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if num_reqs == 0 or x.shape[0] == 0:
        return out
    block_c = min(triton.next_power_of_2(channels), 256)
    grid = (num_reqs, triton.cdiv(channels, block_c))
    _conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, out, query_start_loc,
        seats, x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        conv_state.stride(2), out.stride(0), channels, K=taps, BLOCK_C=block_c,
        BLOCK_K=triton.next_power_of_2(taps), HAS_BIAS=bias is not None, SILU=silu)
    return out
