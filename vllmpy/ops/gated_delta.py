"""The gated delta rule of Gated DeltaNet layers over a step's requests, each request's
state carried between steps in its seat: a token-by-token PyTorch reference, a chunked
PyTorch form for prefills, and Triton kernels (a decode step and a variable-length
prefill).

Per value head h (key head h // (Hv / Hk): consecutive value heads share a key head) and
token t, with q and k L2-normalised (``use_qk_l2norm``) and q scaled by 1/sqrt(dk), the
state S [dk, dv] goes

    S = S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S = S + k_t delta^T;  o_t = S^T q_t

(transformers' ``torch_recurrent_gated_delta_rule``). ``g`` is the log of the decay
(<= 0), ``beta`` the write strength, both [T, Hv]. Everything is computed in float32; the
output comes back in v's dtype, the state is stored in its own.

Request r owns rows ``query_start_loc[r]:query_start_loc[r+1]`` and seat ``seats[r]`` of
``state`` [num_seats + 1, Hv, dk, dv]; the seat holds the state before the step's tokens
and is left holding the state after them. Rows no request owns come out as zeros; a
request with an empty range leaves its seat as it was.

The chunked form takes C tokens at a time: within a chunk, with G_t the cumulative sum of
g from the chunk's start and S0 the state before it, the deltas solve the unit lower
triangular system (I + L) delta = beta * v - (beta * exp(G)) k S0, with
L[t, s] = beta_t exp(G_t - G_s) k_t . k_s for s < t; then
o = (q * exp(G)) S0 + (q k^T * exp(G_t - G_s), s <= t) delta and the state after the chunk
is exp(G_C) S0 + (k * exp(G_C - G))^T delta.

The kernels take one program per (request, value head, block of dv): the state block
[dk, BLOCK_V] stays in registers while the program walks the request's tokens in order,
and goes back to the seat at the end. They read the step's layout from the device only,
so they can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float

L2_EPS = 1e-6  # transformers' (and FLA's) epsilon of the q/k L2 norm


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, state: torch.Tensor) -> tuple[int, int]:
    """(Hv // Hk, dk) after checking the shapes against each other."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [num_tokens, Hk, dk], got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    tokens, hk, dk = q.shape
    if v.dim() != 3 or v.shape[0] != tokens:
        raise ValueError(f"v has shape {tuple(v.shape)}, expected [{tokens}, Hv, dv]")
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"the {hv} value heads are not a multiple of the {hk} key heads")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (tokens, hv):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{tokens}, {hv}]")
    if state.dim() != 4 or tuple(state.shape[1:]) != (hv, dk, dv):
        raise ValueError(f"state has shape {tuple(state.shape)}, expected "
                         f"[num_seats + 1, {hv}, {dk}, {dv}]")
    return hv // hk, dk


def _prepare(q: torch.Tensor, k: torch.Tensor, group: int, use_qk_l2norm: bool,
             scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in float32 on every value head, normalised and q scaled: [T, Hv, dk]."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q, k


def _recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, query_start_loc: list[int],
               seats: list[int], out: torch.Tensor, reqs: list[int]) -> None:
    """The token-by-token recurrence for requests ``reqs`` (prepared float32 q, k), all of
    them a token at a time together, each request's state kept in float32 until the end."""
    starts = [query_start_loc[r] for r in reqs]
    lens = [query_start_loc[r + 1] - query_start_loc[r] for r in reqs]
    where = torch.tensor([seats[r] for r in reqs], device=v.device)
    work = state[where].float()  # [R, Hv, dk, dv]
    for i in range(max(lens)):
        active = [j for j, n in enumerate(lens) if n > i]
        rows = torch.tensor([starts[j] + i for j in active], device=v.device)
        sel = torch.tensor(active, device=v.device)
        s = work[sel] * torch.exp(g[rows].float())[..., None, None]
        k_t = k[rows]  # [R', Hv, dk]
        kv = torch.einsum("rhkv,rhk->rhv", s, k_t)
        delta = (v[rows].float() - kv) * beta[rows].float()[..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        out[rows] = torch.einsum("rhkv,rhk->rhv", s, q[rows]).to(out.dtype)
        work[sel] = s
    state[where] = work.to(state.dtype)


def _owned(query_start_loc: list[int], seats: list[int]) -> list[int]:
    return [r for r in range(len(seats)) if query_start_loc[r + 1] > query_start_loc[r]]


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor, query_start_loc: list[int],
                         seats: list[int], use_qk_l2norm: bool = True,
                         scale: float | None = None) -> torch.Tensor:
    """The oracle: q, k [T, Hk, dk], v [T, Hv, dv], g and beta [T, Hv]; ``state`` read and
    written at ``seats``. Returns o [T, Hv, dv] in v's dtype; token by token."""
    group, _ = _check(q, k, v, g, beta, state)
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    reqs = _owned(query_start_loc, seats)
    if reqs:
        qf, kf = _prepare(q, k, group, use_qk_l2norm, scale)
        _recurrent(qf, kf, v, g, beta, state, query_start_loc, seats, out, reqs)
    return out


def _chunked_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, s: torch.Tensor, chunk: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens (prepared float32 q, k [L, Hv, dk], v [L, Hv, dv], g and beta
    [L, Hv]) from state s [Hv, dk, dv] float32: (o [L, Hv, dv], the state after)."""
    length = q.shape[0]
    chunk = min(chunk, length)  # a short request is one chunk of its own length
    pad = -length % chunk
    # [Hv, chunks, C, ...]; the padded tokens (g = beta = 0, k = v = 0) change nothing
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v.float()))
    g, beta = (F.pad(x.float().t(), (0, pad)) for x in (g, beta))
    heads = q.shape[0]
    q, k, v = (x.reshape(heads, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, -1, chunk), beta.reshape(heads, -1, chunk)
    cum = g.cumsum(-1)  # G_t
    diff = cum[..., :, None] - cum[..., None, :]  # G_t - G_s
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, diff, float("-inf")).exp()  # exp(G_t - G_s), s <= t
    k_beta = k * beta[..., None]
    lower = (k_beta @ k.transpose(-1, -2)) * decay
    system = torch.eye(chunk, device=q.device) + lower.tril(-1)  # I + L
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                      unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # within the chunk, s <= t
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        delta = u[:, c] - w[:, c] @ s  # [Hv, C, dv]
        out[:, c] = q_decayed[:, c] @ s + attn[:, c] @ delta
        s = s * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ delta
    out = out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1)
    return out, s


def gated_delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           query_start_loc: list[int], seats: list[int],
                           use_qk_l2norm: bool = True, scale: float | None = None,
                           chunk: int = 64) -> torch.Tensor:
    """``gated_delta_rule_ref``'s result, faster: requests of one token take one step of
    the recurrence together, longer ones the chunked form one by one."""
    group, _ = _check(q, k, v, g, beta, state)
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    reqs = _owned(query_start_loc, seats)
    if not reqs:
        return out
    qf, kf = _prepare(q, k, group, use_qk_l2norm, scale)
    singles = [r for r in reqs if query_start_loc[r + 1] - query_start_loc[r] == 1]
    if singles:
        _recurrent(qf, kf, v, g, beta, state, query_start_loc, seats, out, singles)
    for r in reqs:
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if end - start < 2:
            continue
        o, s = _chunked_one(qf[start:end], kf[start:end], v[start:end], g[start:end],
                            beta[start:end], state[seats[r]].float(), chunk)
        out[start:end] = o.to(out.dtype)
        state[seats[r]] = s.to(state.dtype)
    return out


# ---- Triton ---------------------------------------------------------------------------

@triton.jit
def _delta_token(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, row, head, key_head,
                 offs_k, mask_k, offs_v, mask_v, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh, scale,
                 L2NORM: tl.constexpr):
    """One token of the recurrence on the state block s [BLOCK_K, BLOCK_V] (float32); the
    token's output block is stored, the new state returned."""
    row = row.to(tl.int64)
    q = tl.load(q_ptr + row * stride_qt + key_head * stride_qh + offs_k, mask=mask_k,
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_kt + key_head * stride_kh + offs_k, mask=mask_k,
                other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    v = tl.load(v_ptr + row * stride_vt + head * stride_vh + offs_v, mask=mask_v,
                other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_gt + head).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_bt + head).to(tl.float32)
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_v,
             o.to(out_ptr.dtype.element_ty), mask=mask_v)
    return s


@triton.jit
def _gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, qsl_ptr,
                        seat_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                        stride_vh, stride_gt, stride_bt, stride_ss, stride_sh, stride_sk,
                        stride_ot, stride_oh, scale, DK, DV, GROUP: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
                        DECODE: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < DV
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < DK
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    if end > start:
        seat = tl.load(seat_ptr + req).to(tl.int64)
        s_ptrs = (state_ptr + seat * stride_ss + head * stride_sh
                  + offs_k[:, None] * stride_sk + offs_v[None, :])
        mask_s = mask_k[:, None] & mask_v[None, :]
        s = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
        key_head = head // GROUP
        if DECODE:  # one token per request
            s = _delta_token(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, start, head,
                             key_head, offs_k, mask_k, offs_v, mask_v, stride_qt, stride_qh,
                             stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                             stride_bt, stride_ot, stride_oh, scale, L2NORM)
        else:
            for i in range(0, end - start):
                s = _delta_token(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, start + i,
                                 head, key_head, offs_k, mask_k, offs_v, mask_v, stride_qt,
                                 stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                 stride_gt, stride_bt, stride_ot, stride_oh, scale, L2NORM)
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask_s)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
            seats: torch.Tensor, use_qk_l2norm: bool, scale: float | None,
            decode: bool) -> torch.Tensor:
    group, dk = _check(q, k, v, g, beta, state)
    for name, t in (("q", q), ("k", k), ("v", v), ("state", state)):
        check_float(name, t, "gated delta kernels")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension")
    num_reqs = seats.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for "
                         f"{num_reqs} requests (expected {num_reqs + 1})")
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if num_reqs == 0 or v.shape[0] == 0:
        return out
    hv, dv = v.shape[1:]
    block_v = min(triton.next_power_of_2(dv), 32)
    grid = (num_reqs, hv, triton.cdiv(dv, block_v))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, state, out, query_start_loc, seats,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), state.stride(0), state.stride(1), state.stride(2),
        out.stride(0), out.stride(1), dk ** -0.5 if scale is None else scale, dk, dv,
        GROUP=group, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        L2NORM=use_qk_l2norm, DECODE=decode)
    return out


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                       seats: torch.Tensor, use_qk_l2norm: bool = True,
                       scale: float | None = None) -> torch.Tensor:
    """One step of the recurrence per request (each range holds one token, or none: a
    padding request), the state updated in place at ``seats``; query_start_loc [R + 1] and
    seats [R] int32 device tensors."""
    return _launch(q, k, v, g, beta, state, query_start_loc, seats, use_qk_l2norm, scale,
                   decode=True)


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor,
                        query_start_loc: torch.Tensor, seats: torch.Tensor,
                        use_qk_l2norm: bool = True, scale: float | None = None
                        ) -> torch.Tensor:
    """``gated_delta_rule_ref`` on the device, over requests of any lengths."""
    return _launch(q, k, v, g, beta, state, query_start_loc, seats, use_qk_l2norm, scale,
                   decode=False)
