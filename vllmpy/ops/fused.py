"""Fused elementwise kernels of the decoder layer: RMSNorm (with the residual add), rotary
embedding and SiLU-and-mul, each one launch where the PyTorch path takes several.

Each kernel follows the PyTorch path of its layer step by step, including where that path
rounds to the input dtype, so bf16 and fp16 results match it to within one unit in the last
place (the fp32 arithmetic differs only in reduction order and fused multiply-adds):

- ``rms_norm``: fp32 x * rsqrt(mean(x^2) + eps), rounded to x's dtype, then times the weight
  (rounded once, to the promoted dtype of x and the weight).
- ``rotary_embedding``: rotate-half (NeoX) rotary in fp32, rounded to the input dtype.
- ``silu_and_mul``: silu in fp32 rounded to x's dtype (as ``F.silu`` returns it), then the
  product in fp32 rounded to x's dtype (as a bf16/fp16 multiply does).

The references are the layers' own PyTorch functions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float, check_same_device
from vllmpy.ops.native import rms_norm_torch, rotary_torch, silu_and_mul_torch
from vllmpy.ops.pdl import pdl_args, pdl_wait

SILU_BLOCK = 1024  # output columns per SiLU-and-mul program


# ---- rms_norm --------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    inner, stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # Row `row` of the flattened [outer * inner, hidden] view sits at (row // inner,
    # row % inner), so a [tokens, heads, head_dim] slice of a wider tensor needs no copy.
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner
    mid = row % inner
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + outer * stride_x_outer + mid * stride_x_inner + cols,
                mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + outer * stride_r_outer + mid * stride_r_inner + cols,
                    mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)  # exact; rounded once on the store
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(name: str, t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t as at most 3-D, inner size, outer stride, inner stride) for the row indexing of
    ``_rms_norm_kernel``; a tensor of more than three dimensions is reshaped (maybe copied)."""
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, "
                         f"got strides {t.stride()}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() > 3:
        t = t.reshape(-1, t.shape[-2], t.shape[-1])
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    return t, t.shape[1], t.stride(0), t.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension of x ([..., hidden], contiguous in ``hidden``).

    Without ``residual`` returns ``weight * normalize(x)``; with it (x's shape and dtype)
    returns ``(rms_norm(s), s)`` for ``s = x + residual`` rounded to x's dtype. Outputs
    are new contiguous tensors; the norm's dtype is that of ``weight * x`` in PyTorch.
    """
    check_float("x", x, "fused kernels")
    check_float("weight", weight, "fused kernels")
    hidden = x.shape[-1] if x.dim() else 0
    if weight.dim() != 1 or weight.shape[0] != hidden or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{hidden}] to match x "
                         f"{tuple(x.shape)}, got {tuple(weight.shape)}")
    check_same_device("weight", weight, x, "the other inputs")
    x3, inner, sxo, sxi = _rows_view("x", x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    if residual is None:
        r3, sro, sri, total = x3, 0, 0, None
    else:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)}), "
                             f"got {residual.dtype} {tuple(residual.shape)}")
        check_same_device("residual", residual, x, "the other inputs")
        r3, _, sro, sri = _rows_view("residual", residual)
        total = torch.empty_like(x, memory_format=torch.contiguous_format)
    rows = x.numel() // hidden if hidden else 0
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x3, r3, weight, out, out if total is None else total,
            inner, sxo, sxi, sro, sri, hidden, eps,
            HAS_RESIDUAL=total is not None, BLOCK=block,
            num_warps=max(1, min(8, block // 256)), **pdl_args(x.device),
        )
    return out if total is None else (out, total)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference for ``rms_norm``: the RMSNorm layer's own math."""
    if residual is None:
        return rms_norm_torch(x, weight, eps)
    x = x + residual
    return rms_norm_torch(x, weight, eps), x


# ---- rotary_embedding ------------------------------------------------------------------

@triton.jit
def load_norm_halves(w_ptr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
                     NORM: tl.constexpr):
    """A per-head RMSNorm weight as its two halves [1, HALF_PAD] in fp32 (0 past
    HEAD_DIM // 2), for ``norm_rotate_halves``; zeros without NORM (nothing is read). A
    kernel can load them before it waits for the one before (vllmpy.ops.pdl)."""
    dims = tl.arange(0, HALF_PAD)[None, :]
    dim_ok = dims < HEAD_DIM // 2
    if NORM:
        w1 = tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HEAD_DIM // 2 + dims, mask=dim_ok, other=0.0).to(tl.float32)
    else:
        w1 = tl.zeros([1, HALF_PAD], tl.float32)
        w2 = tl.zeros([1, HALF_PAD], tl.float32)
    return w1, w2


@triton.jit
def norm_rotate_halves(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr,
                       NORM: tl.constexpr):
    """Rotary (NeoX halves) of some heads given as their two halves x1, x2 [rows,
    HALF_PAD] (loaded in the model's dtype, 0 past HEAD_DIM // 2; cos, sin [1, HALF_PAD]
    fp32); with NORM first an RMSNorm over each head with the weight's halves w1, w2
    (``load_norm_halves``), rounded where rms_norm rounds it. Returns the two rotated
    halves in x1's dtype."""
    ty = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if NORM:
        var = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM  # [rows]
        inv = tl.math.rsqrt(var + eps)[:, None]
        a = (w1 * (a * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        b = (w2 * (b * inv).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    return (a * cos - b * sin).to(ty), (b * cos + a * sin).to(ty)


@triton.jit
def _rotate_heads(src, dst, w_ptr, cos, sin, num_heads, eps,
                  HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                  NORM: tl.constexpr):
    # One token's heads, contiguous at src (read) and dst (written, of src's dtype), as
    # two halves of [HEADS_PAD, HALF_PAD] each through norm_rotate_halves; cos, sin:
    # [1, HALF_PAD]. Returns the two rotated halves.
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HEAD_DIM // 2)
    first = heads * HEAD_DIM + dims  # [HEADS_PAD, HALF_PAD] offsets of the first halves
    second = first + HEAD_DIM // 2
    w1, w2 = load_norm_halves(w_ptr, HEAD_DIM, HALF_PAD, NORM)
    y1, y2 = norm_rotate_halves(tl.load(src + first, mask=mask, other=0.0),
                                tl.load(src + second, mask=mask, other=0.0),
                                w1, w2, cos, sin, eps, HEAD_DIM, NORM)
    tl.store(dst + first, y1, mask=mask)
    tl.store(dst + second, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    stride_q, stride_k, stride_cache, num_q_heads, num_k_heads,
    HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_ok = dims < HEAD_DIM // 2
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + dims, mask=dim_ok, other=0.0)[None, :]  # [1, HALF_PAD]
    sin = tl.load(row + HEAD_DIM // 2 + dims, mask=dim_ok, other=0.0)[None, :]
    _rotate_heads(q_ptr + tok * stride_q, q_out_ptr + tok * num_q_heads * HEAD_DIM, q_ptr,
                  cos, sin, num_q_heads, 0.0, HEAD_DIM, HALF_PAD, HEADS_PAD, False)
    _rotate_heads(k_ptr + tok * stride_k, k_out_ptr + tok * num_k_heads * HEAD_DIM, k_ptr,
                  cos, sin, num_k_heads, 0.0, HEAD_DIM, HALF_PAD, HEADS_PAD, False)


def _check_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be positive and even, got {head_dim}")
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be a [num_tokens] int32 or int64 tensor, "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    num_tokens = positions.shape[0]
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 2 or t.shape[0] != num_tokens or t.shape[1] % head_dim:
            raise ValueError(f"{name} must be [{num_tokens}, num_heads * {head_dim}] to match "
                             f"positions, got {tuple(t.shape)}")
        check_float(name, t, "fused kernels")
        check_same_device(name, t, positions, "the other inputs")
        if t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {t.stride()}")
    if (cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim
            or cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1):
        raise ValueError(f"cos_sin_cache must be a float32 [max_position, {head_dim}] "
                         f"contiguous in its last dimension, got {cos_sin_cache.dtype} "
                         f"{tuple(cos_sin_cache.shape)} strides {cos_sin_cache.stride()}")
    check_same_device("cos_sin_cache", cos_sin_cache, positions, "the other inputs")


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding, out of place.

    positions: [num_tokens] int32/int64, each below ``max_position`` (not checked: that
    would need a device sync); q: [num_tokens, num_heads * head_dim]; k: [num_tokens,
    num_kv_heads * head_dim] (each contiguous in its last dimension; a row stride, as of a
    slice of a packed qkv, is fine); cos_sin_cache: [max_position, head_dim] float32, cos
    in the first half, sin in the second. Returns new contiguous (q, k) of the same shapes.
    """
    _check_rotary(positions, q, k, cos_sin_cache, head_dim)
    num_tokens = positions.shape[0]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_q_heads, num_k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    if num_tokens == 0:
        return q_out, k_out
    heads_pad = triton.next_power_of_2(max(num_q_heads, num_k_heads, 1))
    half_pad = triton.next_power_of_2(head_dim // 2)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q_out, k_out,
        q.stride(0), k.stride(0), cos_sin_cache.stride(0), num_q_heads, num_k_heads,
        HEAD_DIM=head_dim, HALF_PAD=half_pad, HEADS_PAD=heads_pad,
        num_warps=max(1, min(8, heads_pad * half_pad // 256)),
    )
    return q_out, k_out


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor, head_dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference for ``rotary_embedding``: the RotaryEmbedding layer's own math."""
    return rotary_torch(positions, q, k, cos_sin_cache, head_dim)


# ---- qk_norm_rotary --------------------------------------------------------------------

@triton.jit
def _qk_norm_rotary_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cache_ptr, q_out_ptr, k_out_ptr,
    kv_ptr, slot_ptr, num_slots,
    stride_q, stride_k, stride_v, stride_cache, num_q_heads, num_k_heads, eps,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
    STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    dim_ok = dims < HEAD_DIM // 2
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + dims, mask=dim_ok, other=0.0)[None, :]
    sin = tl.load(row + HEAD_DIM // 2 + dims, mask=dim_ok, other=0.0)[None, :]
    _rotate_heads(q_ptr + tok * stride_q, q_out_ptr + tok * num_q_heads * HEAD_DIM,
                  qw_ptr, cos, sin, num_q_heads, eps, HEAD_DIM, HALF_PAD, HEADS_PAD, True)
    k1, k2 = _rotate_heads(k_ptr + tok * stride_k, k_out_ptr + tok * num_k_heads * HEAD_DIM,
                           kw_ptr, cos, sin, num_k_heads, eps, HEAD_DIM, HALF_PAD, HEADS_PAD,
                           True)
    if STORE_KV:
        # the rotated keys and the values into the paged cache, as reshape_and_cache stores
        # them; tokens past the slots, or on a negative slot (padding), store nothing
        slot = tl.load(slot_ptr + tl.minimum(tok, num_slots - 1)).to(tl.int64)
        if (tok < num_slots) & (slot >= 0):
            heads = tl.arange(0, HEADS_PAD)[:, None]
            d2 = dims[None, :]
            mask = (heads < num_k_heads) & (d2 < HEAD_DIM // 2)
            dst = (kv_ptr + (slot // BLOCK_SIZE) * stride_c_blk
                   + (slot % BLOCK_SIZE) * stride_c_slot + heads * stride_c_head + d2)
            tl.store(dst, k1, mask=mask)
            tl.store(dst + HEAD_DIM // 2, k2, mask=mask)
            src = v_ptr + tok * stride_v + heads * HEAD_DIM + d2
            v1 = tl.load(src, mask=mask, other=0.0)
            v2 = tl.load(src + HEAD_DIM // 2, mask=mask, other=0.0)
            tl.store(dst + stride_c_kv, v1, mask=mask)
            tl.store(dst + stride_c_kv + HEAD_DIM // 2, v2, mask=mask)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                   cos_sin_cache: torch.Tensor, head_dim: int,
                   v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
                   slot_mapping: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k followed by rotary, in one launch: the same
    values as ``rms_norm`` on each head and then ``rotary_embedding``. Arguments as
    ``rotary_embedding``, plus the [head_dim] norm weights (of q's dtype) and eps.

    With ``v``, ``kv_cache`` and ``slot_mapping`` the same launch also stores the rotated
    keys and ``v`` into the cache, as ``reshape_and_cache`` would: ``kv_cache`` [2,
    num_blocks, block_size, num_kv_heads, head_dim] of q's dtype (an fp8 cache needs the
    quantizing writer), ``slot_mapping`` [n] for the first n tokens (a negative slot is
    padding and stores nothing)."""
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,) or w.stride(0) != 1 or w.dtype != q.dtype:
            raise ValueError(f"{name} must be a contiguous [{head_dim}] of {q.dtype}, got "
                             f"{w.dtype} {tuple(w.shape)}")
        check_same_device(name, w, q, "q")
    _check_rotary(positions, q, k, cos_sin_cache, head_dim)
    store = kv_cache is not None
    if store:
        _check_store(q, k, v, kv_cache, slot_mapping, head_dim)
        store = slot_mapping.shape[0] > 0  # type: ignore[union-attr]
    num_tokens = positions.shape[0]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    num_q_heads, num_k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    heads_pad = triton.next_power_of_2(max(num_q_heads, num_k_heads, 1))
    half_pad = triton.next_power_of_2(head_dim // 2)
    cache = kv_cache if store else q
    strides = kv_cache.stride()[:4] if store else (0, 0, 0, 0)  # type: ignore[union-attr]
    slots = slot_mapping if store else positions
    _qk_norm_rotary_kernel[(num_tokens,)](
        positions, q, k, v if store else k, q_weight, k_weight, cos_sin_cache, q_out, k_out,
        cache, slots, slots.shape[0],  # type: ignore[union-attr]
        q.stride(0), k.stride(0), v.stride(0) if store else 0,  # type: ignore[union-attr]
        cos_sin_cache.stride(0), num_q_heads, num_k_heads, eps, *strides,
        HEAD_DIM=head_dim, HALF_PAD=half_pad, HEADS_PAD=heads_pad, STORE_KV=store,
        BLOCK_SIZE=kv_cache.shape[2] if store else 1,  # type: ignore[union-attr]
        num_warps=max(1, min(8, heads_pad * half_pad // 256)), **pdl_args(q.device),
    )
    return q_out, k_out


def _check_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                 kv_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None,
                 head_dim: int) -> None:
    if v is None or kv_cache is None or slot_mapping is None:
        raise ValueError("storing into the KV cache needs v, kv_cache and slot_mapping")
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(1) != 1:
        raise ValueError(f"v must match k ({k.dtype} {tuple(k.shape)}) and be contiguous in "
                         f"its last dimension, got {v.dtype} {tuple(v.shape)}")
    num_kv_heads = k.shape[1] // head_dim
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2
            or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim)
            or kv_cache.stride(4) != 1):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, "
                         f"{head_dim}] contiguous in its last dimension, got "
                         f"{tuple(kv_cache.shape)}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache must be of q's dtype ({q.dtype}) to be stored here, got "
                         f"{kv_cache.dtype}")
    if (slot_mapping.dim() != 1 or slot_mapping.shape[0] > k.shape[0]
            or slot_mapping.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slot_mapping must be an int32 or int64 [n] with n <= "
                         f"{k.shape[0]}, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("v", v), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        check_same_device(name, t, q, "q")


def qk_norm_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       cos_sin_cache: torch.Tensor, head_dim: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference for ``qk_norm_rotary``: the layers' own math, one after another."""
    n = positions.shape[0]
    qn = rms_norm_torch(q.reshape(n, -1, head_dim), q_weight, eps).reshape(n, -1)
    kn = rms_norm_torch(k.reshape(n, -1, head_dim), k_weight, eps).reshape(n, -1)
    return rotary_torch(positions, qn, kn, cos_sin_cache, head_dim)


# ---- silu_and_mul ----------------------------------------------------------------------

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    a = tl.load(x_ptr + tok * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + tok * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu rounds its output to x's dtype before the multiply: round here too
    act = (a / (1.0 + tl.exp(-a))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + tok * d + cols, (act * b).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate then up; contiguous in its last dimension) ->
    a new [num_tokens, d] of ``silu(x[:, :d]) * x[:, d:]``."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * d], got {tuple(x.shape)}")
    check_float("x", x, "fused kernels")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or d == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        x, out, d, x.stride(0), BLOCK=block, num_warps=max(1, min(4, block // 256)))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference for ``silu_and_mul``: the SiluAndMul layer's own math."""
    return silu_and_mul_torch(x)
