"""A decode step's attention in one launch from the qkv projection: rotary (after Qwen3's
per-head RMSNorm of q and k, when its weights are given), the new token's key and value
stored into the paged cache, and attention over the cache, plus the split-KV merge when
the keys are split.

What it replaces, per layer: the q/k norm + rotary kernel (which stores the keys and
values) and ``paged_attention``'s decode launch; the values are those of that pair, up to
the order of the fp32 sums that take in the new key.

Layout. One query token per request: token ``i`` belongs to request ``i`` (a decode
step's ``query_start_loc`` is ``arange``). A program takes one request, one KV head and
one split of the request's cached keys: the rows of its dot products are that KV head's
GROUP query heads, padded to 16 for the tensor cores. Every program normalizes and rotates
its query heads itself (a few hundred values). The program whose key range holds the new
token's position (``seq_len - 1``) also normalizes and rotates the new key, stores it and
the new value at the token's slot, and takes them into its softmax from registers; the
tiles it loads from the cache stop before that position, so no program reads a cache entry
this launch writes.

Rotary is the NeoX form (the two halves of each head rotate together), as
``vllmpy.ops.fused.rotary_embedding``: heads are handled as two halves of head_dim / 2,
which must be a power of two of at least 16.

A sliding window, a logit softcap and sinks are taken as ``paged_attention`` takes them,
as constexprs. The window's first key is ``seq_len - window``; the splits divide only the
tiles from the one that holds it, in the attention kernel and the merge alike. A sink
starts split 0's online softmax, so the merge counts it once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllmpy.ops.checks import check_same_device
from vllmpy.ops.fused import load_norm_halves, norm_rotate_halves
from vllmpy.ops.paged_attention import (
    check_features,
    choose_num_splits,
    key_offsets,
    merge_partials,
    num_multiprocessors,
    online_softmax,
    partial_buffers,
    score_scales,
    soft_cap,
    softmax_start,
    store_normalized,
    store_partial,
)
from vllmpy.ops.pdl import pdl_args, pdl_wait

# keys per loop iteration, as paged_attention's decode launch takes them
TILE_N = 64
# A split launch (a small batch's): 32-key tiles, so twice as many programs share a
# request's keys, the attention on 8 warps and its merge on 2, the fastest batch-1 decode
# (docs/perf-log/gpu-dense.md, "the split decode attention retuned").
SPLIT_TILE_N = 32
SPLIT_WARPS = 8
MERGE_WARPS = 2
# Split-KV gives each split at least this many tiles of the request's keys: a shorter
# request uses fewer of the launch's splits (the rest exit at once), and a request that
# needs only one writes its output directly, so the merge has nothing to do for it.
MIN_TILES_PER_SPLIT = 1


@triton.jit
def _load_tile(cache_ptr, table_row, key_pos, key_ok, kv_head, half, dims, stride_c_kv,
               stride_c_blk, stride_c_slot, stride_c_head, HALF: tl.constexpr,
               BLOCK_SIZE: tl.constexpr):
    """One KV head's keys at key_pos as two halves [HALF, TILE] (transposed for the dot)
    and its values [TILE, HEAD_DIM]; masked positions read zeros."""
    key_off = key_offsets(table_row, key_pos, key_ok, kv_head, stride_c_blk, stride_c_slot,
                          stride_c_head, BLOCK_SIZE)  # [TILE]
    k1 = tl.load(cache_ptr + key_off[None, :] + half[:, None], mask=key_ok[None, :],
                 other=0.0)
    k2 = tl.load(cache_ptr + key_off[None, :] + HALF + half[:, None], mask=key_ok[None, :],
                 other=0.0)
    v = tl.load(cache_ptr + stride_c_kv + key_off[:, None] + dims[None, :],
                mask=key_ok[:, None], other=0.0)
    return k1, k2, v


@triton.jit
def _window_start(seq_len, window):
    """The first key a decode's query (at seq_len - 1) sees within the window."""
    return tl.maximum(seq_len - window, 0)


@triton.jit
def _splits_used(tiles, num_splits, MIN_TILES: tl.constexpr):
    """Splits a request of ``tiles`` tiles uses: one per MIN_TILES tiles, at least one."""
    return tl.minimum(num_splits, tl.maximum(tl.cdiv(tiles, MIN_TILES), 1))


@triton.jit
def _attend_tile(q1, q2, k1, k2, v, seen, acc, m_i, l_i, score_scale, softcap_log2,
                 DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """One tile into the running (acc, m, l) of the online softmax; seen [TILE] marks
    the keys the query sees."""
    s = tl.dot(q1, k1, input_precision=DOT_PRECISION)
    s = tl.dot(q2, k2, acc=s, input_precision=DOT_PRECISION) * score_scale
    if SOFTCAP:
        s = soft_cap(s, softcap_log2)
    s = tl.where(seen[None, :], s, float("-inf"))  # [BLOCK_M, TILE]
    p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(q1.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _new_token(src, kv_head, num_heads, num_kv_heads, half, dims, HEAD_DIM: tl.constexpr,
               HALF: tl.constexpr):
    """The new token's key (two halves [1, HALF]) and value [HEAD_DIM] of one KV head,
    from its qkv row at src, before rotary and any norm."""
    k_src = src + (num_heads + kv_head) * HEAD_DIM + half[None, :]
    v = tl.load(src + (num_heads + num_kv_heads + kv_head) * HEAD_DIM + dims)
    return tl.load(k_src), tl.load(k_src + HALF), v


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_attention_kernel(
    qkv_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, slot_ptr,
    cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, block_table_ptr, sinks_ptr,
    score_scale, eps, window, softcap_log2, num_splits, num_heads, num_kv_heads,
    stride_qkv, stride_cs, stride_o_tok, stride_o_head,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    MIN_TILES: tl.constexpr, QK_NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tok = seq.to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows  # [BLOCK_M] query heads
    half = tl.arange(0, HALF)
    dims = tl.arange(0, HEAD_DIM)

    # Until the wait, nothing is read that the kernel before (the qkv projection) writes:
    # the request's length, position, slot, block table and cached keys and values are
    # the step's inputs or earlier steps' writes, the norm weights are never written
    # (vllmpy.ops.pdl).
    seq_len = tl.load(seq_lens_ptr + seq)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + half)[None, :]  # [1, HALF] fp32
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + half)[None, :]
    # This program's tiles of the request's keys (those from kv_start on); the last key
    # (the new token) is taken from qkv by the program whose range holds it, the others
    # come from the cache.
    last = seq_len - 1
    num_tiles = tl.cdiv(seq_len, TILE)
    tile_first = 0
    if SLIDING:
        kv_start = _window_start(seq_len, window)
        tile_first = kv_start // TILE
    used = 1  # splits this request uses
    table_row = block_table_ptr + seq * stride_bt
    cols = tl.arange(0, TILE)
    if SPLIT:
        used = _splits_used(num_tiles - tile_first, num_splits, MIN_TILES)
        per_split = tl.cdiv(num_tiles - tile_first, used)
        tile_lo = tile_first + split * per_split
        tile_hi = tl.minimum(num_tiles, tile_lo + per_split)
        # A split launch is a small batch's: its first tile streams in while the kernel
        # before finishes; at a decode's usual lengths it is the program's only one. (All
        # masked when the range is empty: it then changes nothing.)
        key_pos = tile_lo * TILE + cols  # [TILE]
        key_ok = (key_pos < last) & (key_pos < tile_hi * TILE)
        k1, k2, v = _load_tile(cache_ptr, table_row, key_pos, key_ok, kv_head, half, dims,
                               stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
                               HALF, BLOCK_SIZE)
        # so do the new token's slot and the norm weights (never written)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        qw1, qw2 = load_norm_halves(qw_ptr, HEAD_DIM, HALF, QK_NORM)
        kw1, kw2 = load_norm_halves(kw_ptr, HEAD_DIM, HALF, QK_NORM)
    else:
        tile_lo = tile_first
        tile_hi = num_tiles
    pdl_wait(PDL)
    if SPLIT and split >= used:
        return

    src = qkv_ptr + tok * stride_qkv
    q_off = head[:, None] * HEAD_DIM + half[None, :]  # [BLOCK_M, HALF]
    q1 = tl.load(src + q_off, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(src + q_off + HALF, mask=row_ok[:, None], other=0.0)
    if SPLIT:
        # A split program is short: it reads the new token's key and value beside q (a
        # few hundred bytes, read by every program; the one whose range holds the token
        # takes them in). A batched program, with its longer tile loop, reads them after
        # the loop rather than hold them in registers through it.
        k1_new, k2_new, v_new = _new_token(src, kv_head, num_heads, num_kv_heads, half,
                                           dims, HEAD_DIM, HALF)
    else:
        qw1, qw2 = load_norm_halves(qw_ptr, HEAD_DIM, HALF, QK_NORM)
    q1, q2 = norm_rotate_halves(q1, q2, qw1, qw2, cos, sin, eps, HEAD_DIM, QK_NORM)

    # running max (log2 domain) and running sum of exp2(s - m_i); a sink joins split 0's
    m_i, l_i = softmax_start(sinks_ptr, head, row_ok, split == 0, BLOCK_M, SINKS)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first = tile_lo
    # A window's first tile is loaded whole (its keys before the window are cached keys
    # like the others) and masked in the scores.
    if SPLIT:
        seen = key_ok
        if SLIDING:
            seen = seen & (key_pos >= kv_start)
        acc, m_i, l_i = _attend_tile(q1, q2, k1, k2, v, seen, acc, m_i, l_i, score_scale,
                                     softcap_log2, DOT_PRECISION, SOFTCAP)
        first = tile_lo + 1
    for tile in range(first, tile_hi):
        key_pos = tile * TILE + cols
        key_ok = key_pos < last
        k1, k2, v = _load_tile(cache_ptr, table_row, key_pos, key_ok, kv_head, half, dims,
                               stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
                               HALF, BLOCK_SIZE)
        seen = key_ok
        if SLIDING:
            seen = seen & (key_pos >= kv_start)
        acc, m_i, l_i = _attend_tile(q1, q2, k1, k2, v, seen, acc, m_i, l_i, score_scale,
                                     softcap_log2, DOT_PRECISION, SOFTCAP)

    last_tile = last // TILE
    if (seq_len > 0) & (last_tile >= tile_lo) & (last_tile < tile_hi):
        # the new token: its key normalized and rotated, and its value, from qkv
        if not SPLIT:
            k1_new, k2_new, v_new = _new_token(src, kv_head, num_heads, num_kv_heads, half,
                                               dims, HEAD_DIM, HALF)
            kw1, kw2 = load_norm_halves(kw_ptr, HEAD_DIM, HALF, QK_NORM)
            slot = tl.load(slot_ptr + tok).to(tl.int64)
        k1n, k2n = norm_rotate_halves(k1_new, k2_new, kw1, kw2, cos, sin, eps, HEAD_DIM,
                                      QK_NORM)
        if slot >= 0:  # a negative slot is padding: nothing to store
            dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk
                   + (slot % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head)
            tl.store(dst + half[None, :], k1n)
            tl.store(dst + HALF + half[None, :], k2n)
            tl.store(dst + stride_c_kv + dims, v_new)
        s_new = (tl.sum(q1.to(tl.float32) * k1n.to(tl.float32), 1)
                 + tl.sum(q2.to(tl.float32) * k2n.to(tl.float32), 1)) * score_scale
        if SOFTCAP:
            s_new = soft_cap(s_new, softcap_log2)
        p, alpha, m_new, l_i = online_softmax(s_new[:, None], m_i, l_i)  # p: [BLOCK_M, 1]
        # p rounds to the model's dtype before it weighs the value, as in the tiles' dot
        acc = (acc * alpha[:, None]
               + p.to(q1.dtype).to(tl.float32) * v_new.to(tl.float32)[None, :])
        m_i = m_new

    if used > 1:
        # partials: acc [num_tokens, num_heads, num_splits, HEAD_DIM], (m, l) [..., 2]
        part = (tok * num_heads + head) * num_splits + split  # [BLOCK_M]
        store_partial(part_acc_ptr, part_ml_ptr, part, acc, m_i, l_i, row_ok, HEAD_DIM)
    else:
        store_normalized(out_ptr, tok * stride_o_tok + head * stride_o_head, acc, l_i,
                         row_ok[:, None], HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, seq_lens_ptr, window, num_splits,
                  num_heads, stride_o_tok, stride_o_head, TILE: tl.constexpr,
                  MIN_TILES: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  SLIDING: tl.constexpr, PDL: tl.constexpr):
    # One (request, query head): the softmax-weighted sum of the partials of the splits
    # the request used; a request that used one split has its output already. The
    # request's length is a step input, read before the wait (vllmpy.ops.pdl).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + tok)
    tiles = tl.cdiv(seq_len, TILE)
    if SLIDING:
        tiles -= _window_start(seq_len, window) // TILE
    used = _splits_used(tiles, num_splits, MIN_TILES)
    pdl_wait(PDL)
    if used == 1:
        return
    merge_partials(part_acc_ptr, part_ml_ptr, out_ptr, tok, head, num_heads, num_splits,
                   used, tok * stride_o_tok + head * stride_o_head, HEAD_DIM,
                   SPLITS_PAD, HEAD_DIM)


def supports(head_dim: int, kv_cache: torch.Tensor, dtype: torch.dtype, *,
             sliding_window: int | None = None, logit_softcap: float | None = None) -> bool:
    """Whether ``decode_attention`` takes this geometry: head_dim / 2 a power of two of at
    least 16, and a cache of the model's own dtype (an fp8 cache needs the quantizing
    writer). Every sliding window and logit softcap is taken, alone or together, and so
    are sinks."""
    del sliding_window, logit_softcap  # the kernel handles both
    half = head_dim // 2
    return (head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0
            and kv_cache.dtype == dtype)


def decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, *, num_heads: int,
                     scale: float, max_seq_len: int, q_norm_weight: torch.Tensor | None = None,
                     k_norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     num_splits: int | None = None,
                     min_tiles_per_split: int = MIN_TILES_PER_SPLIT,
                     sliding_window: int | None = None,
                     logit_softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [num_seqs, num_heads, head_dim] of a decode step, one query token
    per request (token i is request i's: a decode step's query_start_loc is arange), from
    ``qkv`` [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim] (q, k, v packed, before
    rotary and any q/k norm). Stores each new key (normed and rotated) and value at its
    ``slot_mapping`` entry (a negative slot stores nothing). ``positions`` [num_seqs]
    index ``cos_sin_cache`` [max_position, head_dim] (cos, then sin). With
    ``q_norm_weight`` and ``k_norm_weight`` ([head_dim], of qkv's dtype) q and k get
    Qwen3's per-head RMSNorm (``eps``) first. ``max_seq_len`` and ``num_splits`` as in
    ``paged_attention``; a request uses at most one split per ``min_tiles_per_split``
    tiles of its keys (of its window's, with a window). ``sliding_window``,
    ``logit_softcap`` and ``sinks`` as in ``paged_attention``."""
    check_features(sliding_window, logit_softcap, sinks, num_heads, qkv.device)
    num_seqs = seq_lens.shape[0]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], contiguous in head_dim, got {tuple(kv_cache.shape)}")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if not supports(head_dim, kv_cache, qkv.dtype):
        raise ValueError(f"decode_attention takes head_dim / 2 a power of two >= 16 and a "
                         f"cache of qkv's dtype ({qkv.dtype}); got head_dim {head_dim}, "
                         f"cache {kv_cache.dtype}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if (qkv.dim() != 2 or tuple(qkv.shape) != (num_seqs, width) or qkv.stride(1) != 1
            or num_heads % num_kv_heads):
        raise ValueError(f"qkv must be [{num_seqs}, {width}] (one token per request, "
                         f"{num_heads} query heads, a multiple of the cache's "
                         f"{num_kv_heads} KV heads) contiguous in its last dimension, got "
                         f"{tuple(qkv.shape)}")
    for name, t, shape, dtypes in (
            ("positions", positions, (num_seqs,), (torch.int32, torch.int64)),
            ("slot_mapping", slot_mapping[:num_seqs], (num_seqs,), (torch.int32, torch.int64)),
            ("block_tables", block_tables, (num_seqs, block_tables.shape[-1]), (torch.int32,)),
            ("seq_lens", seq_lens, (num_seqs,), (torch.int32,))):
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))} of shape {shape}, "
                             f"got {t.dtype} {tuple(t.shape)}")
        check_same_device(name, t, qkv, "qkv")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or \
            cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be float32 [max_position, {head_dim}], got "
                         f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    qk_norm = q_norm_weight is not None
    if qk_norm != (k_norm_weight is not None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (tuple(w.shape) != (head_dim,) or w.dtype != qkv.dtype
                              or w.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] of {qkv.dtype}, "
                             f"got {w.dtype} {tuple(w.shape)}")
    for name, t in (("kv_cache", kv_cache), ("cos_sin_cache", cos_sin_cache)):
        check_same_device(name, t, qkv, "qkv")
    if block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dimension, got "
                         f"strides {block_tables.stride()}")
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_seqs == 0:
        return out
    if num_splits is None:
        span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
        num_splits = choose_num_splits(num_seqs * num_kv_heads, span,
                                       num_multiprocessors(qkv.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if min_tiles_per_split < 1:
        raise ValueError(f"min_tiles_per_split must be at least 1, got {min_tiles_per_split}")
    part_acc, part_ml = partial_buffers(out, num_seqs, num_heads, num_splits, head_dim)
    group = num_heads // num_kv_heads
    tile = SPLIT_TILE_N if num_splits > 1 else TILE_N  # the merge counts the same tiles
    pdl = pdl_args(qkv.device)
    score_scale, softcap_log2 = score_scales(scale, logit_softcap)
    window = sliding_window or 0
    sliding = sliding_window is not None
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        qkv, positions, cos_sin_cache, q_norm_weight if qk_norm else qkv,
        k_norm_weight if qk_norm else qkv, slot_mapping,
        kv_cache, out, part_acc, part_ml, seq_lens, block_tables,
        qkv if sinks is None else sinks, score_scale, float(eps), window, softcap_log2, num_splits, num_heads, num_kv_heads,
        qkv.stride(0), cos_sin_cache.stride(0), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), TILE=tile,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, SPLIT=num_splits > 1,
        MIN_TILES=min_tiles_per_split, QK_NORM=qk_norm,
        DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        SLIDING=sliding, SOFTCAP=logit_softcap is not None, SINKS=sinks is not None,
        num_warps=SPLIT_WARPS if num_splits > 1 else 4, num_stages=3, **pdl,
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, out, seq_lens, window, num_splits, num_heads,
            out.stride(0), out.stride(1), TILE=tile, MIN_TILES=min_tiles_per_split,
            SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            SLIDING=sliding, num_warps=MERGE_WARPS, **pdl,
        )
    return out
