"""The Mamba2 (SSD) recurrence over a step's requests: a token-by-token PyTorch reference,
a chunked PyTorch scan for prefill, and Triton kernels (a decode step and a
variable-length prefill) with their launchers.

Per head h of a token t, with x [H, P] (P = head_dim), B and C [G, N] (G groups of heads
share them, N = d_state), dt [H] raw from the input projection:

    dt  = clamp(softplus(dt + dt_bias), *dt_limit)
    dA  = exp(dt * A)                     (A = -exp(A_log) < 0, one per head)
    S   = S * dA + dt * (x outer B)       (S [H, P, N], the recurrent state)
    y   = S . C + D * x                   (y [H, P])

B and C of head h are those of its group h // (H // G). Every computation is float32;
the state is stored in its own tensor's dtype, and y in ``out_dtype`` (x's dtype unless
asked otherwise: the Mamba2 mixer takes it in float32 into its gated norm).

A step's tokens are the concatenation of its requests': request r owns rows
``query_start_loc[r]:query_start_loc[r+1]`` and its state lives in seat
``seats[r]`` of ``state`` [num_seats + 1, H, P, N]. The seat holds the state before the
request's tokens on entry (zeros for a request that starts) and after them on return. Rows
that no request owns (padding) come out as zeros.

Kernels. Both take one program per (request, head, block of BLOCK_P head-dim rows) and keep
the [BLOCK_P, N] state tile in registers: ``ssd_decode`` runs one token per request,
``ssd_prefill`` walks a request's tokens in order. Each reads the step's layout from the
device (``query_start_loc``, ``seats``) and nothing from the host but shapes, so the
launches can be captured in a CUDA graph. A request with an empty query range (a padding
request) leaves its seat as it was.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float

# softplus returns x itself above this (torch's default threshold)
SOFTPLUS_THRESHOLD = 20.0
# the largest finite float32, standing in for an infinite dt limit inside the kernels
_FLOAT32_MAX = 3.4028234663852886e38


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                  dt_limit: tuple[float, float]) -> torch.Tensor:
    """clamp(softplus(dt + dt_bias), *dt_limit) in float32, for dt [..., H]."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])


def _per_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each group's row repeated for its heads."""
    return t.float().repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_step_ref(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                 B: torch.Tensor, C: torch.Tensor, D: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of R rows: state [R, H, P, N] float32, x [R, H, P], dt [R, H]
    (discretized), A and D [H], B and C [R, G, N]. Returns (y [R, H, P], new state), both
    float32."""
    heads = x.shape[-2]
    Bh, Ch = _per_head(B, heads), _per_head(C, heads)  # [R, H, N]
    x = x.float()
    decay = torch.exp(dt * A.float())  # [R, H]
    state = (state * decay[..., None, None]
             + (dt[..., None] * x)[..., None] * Bh[..., None, :])  # [R, H, P, N]
    y = (state * Ch[..., None, :]).sum(-1) + D.float()[:, None] * x
    return y, state


def _check_layout(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  state: torch.Tensor) -> None:
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    if dt.shape != (tokens, heads):
        raise ValueError(f"dt has shape {tuple(dt.shape)}, expected {(tokens, heads)}")
    if B.shape != C.shape or B.shape[0] != tokens:
        raise ValueError(f"B {tuple(B.shape)} and C {tuple(C.shape)} must both be "
                         f"[{tokens}, n_groups, d_state]")
    if heads % groups:
        raise ValueError(f"n_groups ({groups}) must divide the {heads} heads")
    if state.dim() != 4 or tuple(state.shape[1:]) != (heads, head_dim, d_state):
        raise ValueError(f"state has shape {tuple(state.shape)}, expected "
                         f"[num_seats + 1, {heads}, {head_dim}, {d_state}]")


def ssd_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                  state: torch.Tensor, query_start_loc: list[int], seats: list[int],
                  dt_limit: tuple[float, float] = (0.0, math.inf), *,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The recurrence token by token (the oracle): x [T, H, P], dt [T, H] raw, B and C
    [T, G, N]; ``state`` [num_seats + 1, H, P, N] is read and written at ``seats``.
    Returns y [T, H, P] in ``out_dtype`` (None: x's dtype)."""
    _check_layout(x, dt, B, C, state)
    y = torch.zeros(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    dt = discretize_dt(dt, dt_bias, dt_limit)
    for r, seat in enumerate(seats):
        s = state[seat].float()[None]  # [1, H, P, N]
        for t in range(query_start_loc[r], query_start_loc[r + 1]):
            out, s = ssd_step_ref(s, x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D)
            y[t] = out[0].to(y.dtype)
        if query_start_loc[r + 1] > query_start_loc[r]:
            state[seat] = s[0].to(state.dtype)
    return y


def _scan_one(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor, state: torch.Tensor, chunk: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's L tokens in chunks of ``chunk``: x [L, H, P], dt [L, H] discretized,
    B and C [L, H, N] per head, state [H, P, N]; all float32. Returns (y, final state).

    Within a chunk, with a = dt * A and seg[l, s] = a[s+1] + ... + a[l] (the log decay from
    token s to token l), y[l] = sum_{s<=l} exp(seg[l, s]) (C[l].B[s]) dt[s] x[s] (the
    chunk's own tokens) + exp(a[0] + ... + a[l]) C[l].S (the state it started from)."""
    length = x.shape[0]
    ys = []
    for c0 in range(0, length, chunk):
        xs, dts = x[c0:c0 + chunk], dt[c0:c0 + chunk]
        Bs, Cs = B[c0:c0 + chunk], C[c0:c0 + chunk]
        q = xs.shape[0]
        a = dts * A  # [q, H]
        # seg[l, s, h]: sum of a[j, h] over s < j <= l, -inf above the diagonal
        ones = torch.ones(q, q, dtype=torch.bool, device=x.device)
        below = torch.tril(ones, -1)[..., None]  # [l, s, 1]: s < l
        seg = torch.cumsum(a[:, None, :].expand(q, q, -1).masked_fill(~below, 0), dim=0)
        seg = seg.masked_fill(~torch.tril(ones)[..., None], -math.inf)
        weights = torch.einsum("lhn,shn->lsh", Cs, Bs) * torch.exp(seg) * dts[None]
        y = torch.einsum("lsh,shp->lhp", weights, xs)
        from_start = torch.exp(torch.cumsum(a, dim=0))  # [q, H]
        y = y + from_start[..., None] * torch.einsum("lhn,hpn->lhp", Cs, state)
        ys.append(y + D[None, :, None] * xs)
        to_end = torch.exp(seg[-1]) * dts  # [q, H]: decay from each token to the chunk's end
        state = (from_start[-1][:, None, None] * state
                 + torch.einsum("sh,shp,shn->hpn", to_end, xs, Bs))
    return torch.cat(ys), state


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                query_start_loc: list[int], seats: list[int],
                dt_limit: tuple[float, float] = (0.0, math.inf), chunk: int = 64, *,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``ssd_reference``'s result through a chunked scan per request (``_scan_one``), the
    requests of one token batched into a single step: the CPU path."""
    _check_layout(x, dt, B, C, state)
    heads = x.shape[1]
    y = torch.zeros(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    dt = discretize_dt(dt, dt_bias, dt_limit)
    A, D = A.float(), D.float()
    singles = [r for r in range(len(seats))
               if query_start_loc[r + 1] - query_start_loc[r] == 1]
    if singles:
        rows = torch.tensor([query_start_loc[r] for r in singles], device=x.device)
        where = torch.tensor([seats[r] for r in singles], device=x.device)
        out, new = ssd_step_ref(state[where].float(), x[rows], dt[rows], A, B[rows],
                                C[rows], D)
        y[rows] = out.to(y.dtype)
        state[where] = new.to(state.dtype)
    for r, seat in enumerate(seats):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if end - start < 2:
            continue
        out, new = _scan_one(x[start:end].float(), dt[start:end], A,
                             _per_head(B[start:end], heads), _per_head(C[start:end], heads),
                             D, state[seat].float(), chunk)
        y[start:end] = out.to(y.dtype)
        state[seat] = new.to(state.dtype)
    return y


# ---- Triton ------------------------------------------------------------------------------


@triton.jit
def _discretize(dt, dt_bias, dt_min, dt_max):
    v = dt + dt_bias
    v = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))  # softplus, torch's threshold
    return tl.minimum(tl.maximum(v, dt_min), dt_max)


@triton.jit
def _ssd_token(s, t, h, g, offs_p, mask_p, offs_n, mask_n, A, D, dt_bias, dt_min, dt_max,
               x_ptr, dt_ptr, B_ptr, C_ptr, y_ptr, stride_xt, stride_xh, stride_dtt,
               stride_bt, stride_bg, stride_ct, stride_cg, stride_yt, stride_yh):
    """One token's update of the [BLOCK_P, BLOCK_N] state tile ``s``; stores y, returns s."""
    t = t.to(tl.int64)
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs_p, mask=mask_p,
                other=0.0).to(tl.float32)
    dt = _discretize(tl.load(dt_ptr + t * stride_dtt + h).to(tl.float32), dt_bias,
                     dt_min, dt_max)
    b = tl.load(B_ptr + t * stride_bt + g * stride_bg + offs_n, mask=mask_n,
                other=0.0).to(tl.float32)
    c = tl.load(C_ptr + t * stride_ct + g * stride_cg + offs_n, mask=mask_n,
                other=0.0).to(tl.float32)
    s = s * tl.exp(dt * A) + (dt * x)[:, None] * b[None, :]
    y = tl.sum(s * c[None, :], axis=1) + D * x
    tl.store(y_ptr + t * stride_yt + h * stride_yh + offs_p,
             y.to(y_ptr.dtype.element_ty), mask=mask_p)
    return s


@triton.jit(do_not_specialize=["dt_min", "dt_max"])
def _ssd_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, y_ptr,
                qsl_ptr, seat_ptr, stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg,
                stride_ct, stride_cg, stride_ss, stride_sh, stride_sp, stride_yt, stride_yh,
                dt_min, dt_max, heads_per_group, head_dim, d_state,
                BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr):
    req = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < head_dim
    mask_n = offs_n < d_state
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    if end > start:
        seat = tl.load(seat_ptr + req).to(tl.int64)
        g = h // heads_per_group
        s_ptrs = (state_ptr + seat * stride_ss + h * stride_sh
                  + offs_p[:, None] * stride_sp + offs_n[None, :])
        s_mask = mask_p[:, None] & mask_n[None, :]
        s = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
        A = tl.load(A_ptr + h).to(tl.float32)
        D = tl.load(D_ptr + h).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        if DECODE:  # one token per request
            s = _ssd_token(s, start, h, g, offs_p, mask_p, offs_n, mask_n, A, D, dt_bias,
                           dt_min, dt_max, x_ptr, dt_ptr, B_ptr, C_ptr, y_ptr, stride_xt,
                           stride_xh, stride_dtt, stride_bt, stride_bg, stride_ct,
                           stride_cg, stride_yt, stride_yh)
        else:
            for i in range(0, end - start):
                s = _ssd_token(s, start + i, h, g, offs_p, mask_p, offs_n, mask_n, A, D, dt_bias,
                               dt_min, dt_max, x_ptr, dt_ptr, B_ptr, C_ptr, y_ptr,
                               stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg,
                               stride_ct, stride_cg, stride_yt, stride_yh)
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=s_mask)


def _block_sizes(head_dim: int, d_state: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N): the whole state width, and head-dim rows up to a 4,096-element
    tile (the state tile lives in registers)."""
    block_n = triton.next_power_of_2(d_state)
    block_p = max(1, min(triton.next_power_of_2(head_dim), 4096 // block_n))
    return block_p, block_n


def _launch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
            C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
            query_start_loc: torch.Tensor, seats: torch.Tensor,
            dt_limit: tuple[float, float], decode: bool, out_dtype: torch.dtype | None
            ) -> torch.Tensor:
    _check_layout(x, dt, B, C, state)
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C), ("state", state)):
        check_float(name, t, "SSD kernels")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    num_reqs = seats.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for "
                         f"{num_reqs} requests (expected {num_reqs + 1})")
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    y = torch.zeros((tokens, heads, head_dim), dtype=out_dtype or x.dtype, device=x.device)
    if num_reqs == 0 or tokens == 0:
        return y
    block_p, block_n = _block_sizes(head_dim, d_state)
    grid = (num_reqs, heads, triton.cdiv(head_dim, block_p))
    _ssd_kernel[grid](
        x, dt, A, B, C, D, dt_bias, state, y, query_start_loc, seats,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
        C.stride(1), state.stride(0), state.stride(1), state.stride(2), y.stride(0),
        y.stride(1), float(max(dt_limit[0], -_FLOAT32_MAX)),
        float(min(dt_limit[1], _FLOAT32_MAX)), heads // groups, head_dim, d_state,
        BLOCK_P=block_p, BLOCK_N=block_n, DECODE=decode)
    return y


def ssd_decode(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
               query_start_loc: torch.Tensor, seats: torch.Tensor,
               dt_limit: tuple[float, float] = (0.0, math.inf), *,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A decode step (each request has at most one token, row ``query_start_loc[r]``) on
    the device: ``ssd_reference``'s result and state update, query_start_loc [R + 1] and
    seats [R] int32 device tensors. The last dimension of x, dt, B, C and state must be
    contiguous; other strides are free (slices of a projection are taken as they are).
    y comes in ``out_dtype`` (None: x's dtype)."""
    return _launch(x, dt, A, B, C, D, dt_bias, state, query_start_loc, seats, dt_limit,
                   decode=True, out_dtype=out_dtype)


def ssd_prefill(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                query_start_loc: torch.Tensor, seats: torch.Tensor,
                dt_limit: tuple[float, float] = (0.0, math.inf), *,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Any mix of request lengths (prefill chunks and decodes), as ``ssd_decode`` takes
    its arguments; each request's tokens are walked in order from its seat's state."""
    return _launch(x, dt, A, B, C, D, dt_bias, state, query_start_loc, seats, dt_limit,
                   decode=False, out_dtype=out_dtype)
