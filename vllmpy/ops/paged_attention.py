"""Paged attention over the KV cache: Triton kernels, their launchers and PyTorch references.

The KV cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim]; slot s
is token ``s % block_size`` of block ``s // block_size``.

``reshape_and_cache`` stores a step's new keys and values at their slots.

``paged_attention`` computes attention for a mixed batch in one launch. Request i owns
query rows ``query_start_loc[i]:query_start_loc[i+1]``; they are the last tokens of its
``seq_lens[i]`` tokens, so query j of a request of q_len queries sits at position
``seq_len - q_len + j`` and sees the keys at positions up to there (cached context plus
causal attention within the chunk). A decode is simply a request with one query.

Kernel layout. A program takes one *query block* (BLOCK_Q consecutive query tokens of
one request times the GROUP query heads that share one KV head, flattened into BLOCK_M
rows so a tensor-core dot applies even to a single decode token) and one KV head, and
streams that request's keys in tiles of TILE_N tokens through an fp32 online softmax.
Grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads, num_splits). The first axis is an
upper bound on the query blocks of any batch with that many tokens and requests, so it
depends on no device value; a program finds its request by binary search over
``query_start_loc`` and exits when its block lies past the request's queries.

Split-KV (flash-decoding). When the batch gives too few programs to fill the GPU (a few
long decodes), each query block's key range is cut into ``num_splits`` equal runs of
tiles, each program writes an unnormalised partial result (accumulator, running max and
sum), and a second kernel merges the partials. ``choose_num_splits`` picks the count.

Every size the kernels need is either a device tensor or a launcher argument the caller
knows on the host (``max_query_len``, ``max_seq_len``), so the launches can be captured
in a CUDA graph.

fp8 KV cache. A cache of dtype ``torch.float8_e4m3fn`` stores one byte per value:
``reshape_and_cache`` writes ``clamp(x / scale, -448, 448)`` converted to e4m3, and
``paged_attention`` loads the fp8 page and converts it to the query's dtype (exactly), with
the key scale folded into the score scale and the value scale applied to the weighted sum,
one ``k_scale`` and one ``v_scale`` per layer. Caches of
other dtypes ignore the scales. On CUDA, e4m3 needs compute capability 8.9 or newer.

Attention features (Gemma-2/3, Mistral), each a constexpr of the kernels, so a launch
without them compiles to the plain kernel:
- ``sliding_window`` W: the query at position p sees the keys at positions p - W + 1 .. p.
  A query block's loop starts at the tile of the first key its earliest query sees, and
  split-KV divides only the tiles from there, so a long request with a small window
  costs window-sized work.
- ``logit_softcap`` c: a score s = scale * q.k becomes c * tanh(s / c) before the softmax.
- ``sinks`` [num_heads] (GPT-OSS): one logit per query head that joins each of its
  queries' softmax denominators and weighs no value (softmax over [scores, sink], the
  sink's share dropped). The online softmax starts from it, running max = sink and running
  sum = 1, instead of -inf and 0; under split-KV only split 0 starts from it, so the merge
  counts it once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float, check_same_device
from vllmpy.ops.pdl import pdl_args, pdl_wait

MAX_HEAD_DIM = 256
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = tl.constexpr(448.0)  # the largest finite e4m3 value; fp8 writes clamp to it
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_KV_DTYPE)
# Split-KV gives each program at least this many keys; below it the merge costs more
# than the parallelism gains.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# Programs per multiprocessor that split-KV aims for: a memory-bound program needs
# company on its multiprocessor to keep enough loads in flight.
PROGRAMS_PER_SM = 2
LOG2E = math.log2(math.e)
TWO_LOG2E = tl.constexpr(2 * LOG2E)
SINK_LOG2E = tl.constexpr(LOG2E)  # a sink logit into the kernels' log2 domain


# ---- reshape_and_cache -----------------------------------------------------------------

@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, k_scale, v_scale,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    QUANT: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # a padding token (CUDA graph batch padding): nothing to store
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)  # [HEADS_PAD, DIM_PAD]
    dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
           + heads * stride_c_head + dims)
    k = tl.load(k_ptr + tok * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    if QUANT:  # fp8 cache: quantize with the layer's scales (IEEE division, as torch's),
        # saturating at +-448
        k = tl.minimum(tl.maximum(tl.div_rn(k.to(tl.float32), k_scale), -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(tl.div_rn(v.to(tl.float32), v_scale), -FP8_MAX), FP8_MAX)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Store k and v ([num_tokens, num_kv_heads, head_dim]) into ``kv_cache``
    ([2, num_blocks, block_size, num_kv_heads, head_dim]) at ``slot_mapping``
    ([num_tokens], int32 or int64); a negative slot skips its token. An fp8 cache stores
    ``clamp(k / k_scale, +-448)`` and ``clamp(v / v_scale, +-448)``."""
    _check_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match "
                             f"kv_cache {tuple(kv_cache.shape)}, got {tuple(t.shape)}")
        check_float(name, t, "Triton attention kernels")
        check_same_device(name, t, kv_cache, "kv_cache")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {t.stride()}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping must be [{k.shape[0]}] (one slot per token), "
                         f"got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    check_same_device("slot_mapping", slot_mapping, kv_cache, "kv_cache")
    quant = kv_cache.dtype == FP8_KV_DTYPE
    if quant:
        _check_scales(k_scale, v_scale)
    if k.shape[0] == 0:
        return
    _reshape_and_cache_kernel[(k.shape[0],)](
        k, v, kv_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim), QUANT=quant,
    )


def reshape_and_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> None:
    """PyTorch reference for ``reshape_and_cache``."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k, v = k[keep], v[keep]
    if kv_cache.dtype == FP8_KV_DTYPE:
        k = (k.float() / k_scale).clamp(-FP8_MAX.value, FP8_MAX.value).to(FP8_KV_DTYPE)
        v = (v.float() / v_scale).clamp(-FP8_MAX.value, FP8_MAX.value).to(FP8_KV_DTYPE)
        # index_copy_ has no fp8 kernel on the CPU: copy the bytes
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat = kv_cache.view(2, -1, k.shape[1], k.shape[2])  # [2, num_slots, kv_heads, head_dim]
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


# ---- paged_attention -------------------------------------------------------------------

# Pieces the attention kernels share (this module's and vllmpy.ops.decode_attention's).

@triton.jit
def owning_request(query_start_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The request owning query block ``q_block`` of a step whose request i starts at block
    query_start[i] // BLOCK_Q + i (the last such i at or before it): (its index, its first
    query row, its query length, the block's index within the request)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        right = tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= q_block
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    seq = lo - 1
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    return seq, q_start, q_len, q_block - (q_start // BLOCK_Q + seq)


@triton.jit
def key_offsets(table_row, key_pos, key_ok, kv_head, stride_c_blk, stride_c_slot,
                stride_c_head, BLOCK_SIZE: tl.constexpr):
    """Cache offsets [TILE] of one KV head's keys at positions key_pos of a request whose
    block-table row is table_row (masked positions read block 0)."""
    block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    return block * stride_c_blk + (key_pos % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_head


@triton.jit
def online_softmax(s, m_i, l_i):
    """One tile of scores s [rows, keys] (log2 domain, -inf where not visible) into the
    running max m_i and sum l_i: returns (p, alpha, m_new, l_new), with acc to be scaled
    by alpha before p's weighted values are added."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def softmax_start(sinks_ptr, head, row_ok, take_sink, BLOCK_M: tl.constexpr,
                  SINKS: tl.constexpr):
    """The online softmax's (running max, running sum) [BLOCK_M] before the first tile, for
    rows of query heads ``head``: (-inf, 0), or with SINKS where ``take_sink``
    (sink * log2(e), 1), as though the sink were a key of that score with a zero value."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * SINK_LOG2E
        start = row_ok & take_sink
        m_i = tl.where(start, sink, m_i)
        l_i = tl.where(start, 1.0, l_i)
    return m_i, l_i


@triton.jit
def soft_cap(x, cap_log2):
    """The softcapped score in the log2 domain, cap * tanh(x) * log2(e), from x = s / cap
    (s the natural-domain score, cap_log2 = cap * log2(e)): tanh as 1 - 2 / (1 + e^2x),
    which saturates to +-1 without overflow."""
    return cap_log2 - 2.0 * cap_log2 / (1.0 + tl.exp2(x * TWO_LOG2E))


def score_scales(scale: float, logit_softcap: float | None) -> tuple[float, float]:
    """(the factor of q.k, the softcap in the log2 domain) as the kernels take them: scores
    are q.k * scale * log2(e), or with a softcap c, q.k * scale / c for ``soft_cap``."""
    if logit_softcap is None:
        return scale * LOG2E, 0.0
    return scale / logit_softcap, logit_softcap * LOG2E


def check_features(sliding_window: int | None, logit_softcap: float | None,
                   sinks: torch.Tensor | None = None, num_heads: int = 0,
                   device: torch.device | None = None) -> None:
    """Refuse a window below 1 (or not an integer), a softcap that is not a positive
    finite number, and sinks that are not a contiguous floating [num_heads] on
    ``device``."""
    if sinks is not None and (tuple(sinks.shape) != (num_heads,)
                              or sinks.dtype not in (torch.float32, torch.bfloat16,
                                                     torch.float16)
                              or sinks.stride(0) != 1 or sinks.device != device):
        raise ValueError(f"sinks must be a contiguous float [{num_heads}] tensor (one logit "
                         f"per query head) on {device}, got {sinks.dtype} "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive integer (or None for no window), "
                         f"got {sliding_window!r}")
    if logit_softcap is not None and not (math.isfinite(logit_softcap) and logit_softcap > 0):
        raise ValueError(f"logit_softcap must be a positive finite number (or None for no "
                         f"softcap), got {logit_softcap!r}")


@triton.jit
def store_partial(part_acc_ptr, part_ml_ptr, part, acc, m_i, l_i, row_ok,
                  DIM_PAD: tl.constexpr):
    """A split's unnormalised rows: acc at part_acc[part] ([..., DIM_PAD]), (m, l) at
    part_ml[part] ([..., 2]); part [rows] indexes (token, head, split)."""
    dims = tl.arange(0, DIM_PAD)
    tl.store(part_acc_ptr + part[:, None] * DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def store_normalized(out_ptr, row_off, acc, l_i, mask, DIM_PAD: tl.constexpr):
    """acc / l (0 where no key was seen) into out at row offsets row_off [rows]."""
    dims = tl.arange(0, DIM_PAD)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + row_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def merge_partials(part_acc_ptr, part_ml_ptr, out_ptr, tok, head, num_heads, num_splits,
                   used, out_off, head_dim, SPLITS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    """The softmax-weighted sum of the first ``used`` splits' partials of (tok, head),
    stored at out + out_off."""
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < used
    part = (tok * num_heads + head) * num_splits + splits  # [SPLITS_PAD]
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    sums = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [SPLITS_PAD]; a split that saw no key has m = -inf: weight 0
    dims = tl.arange(0, DIM_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + dims[None, :],
                  mask=split_ok[:, None], other=0.0)  # [SPLITS_PAD, DIM_PAD]
    denom = tl.sum(sums * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)  # [DIM_PAD]
    tl.store(out_ptr + out_off + dims, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


# Batch-shaped integers (request count, split count, block-table width) change from step
# to step; specializing on them (Triton does for the values 1 and multiples of 16) would
# compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    query_start_ptr, seq_lens_ptr, block_table_ptr, sinks_ptr,
    score_scale, k_scale, v_scale, window, softcap_log2,
    num_seqs, num_splits, num_heads, head_dim,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq, q_start, q_len, local_block = owning_request(query_start_ptr, num_seqs, q_block,
                                                      BLOCK_Q)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r of the block is query token r // GROUP_PAD of the block, head r % GROUP_PAD
    # of this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    row_q = local_block * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] query index in the request
    row_head = kv_head * GROUP + rows % GROUP_PAD  # [BLOCK_M] query head
    row_ok = (row_q < q_len) & (rows % GROUP_PAD < GROUP)
    row_pos = context_len + row_q  # [BLOCK_M] position in the sequence
    row_tok = (q_start + row_q).to(tl.int64)  # [BLOCK_M] row of q / out
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + row_tok[:, None] * stride_q_tok + row_head[:, None] * stride_q_head
                + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    # q: [BLOCK_M, DIM_PAD]

    # Keys at positions [0, kv_end) are visible to some row of the block (with a window,
    # none before the window of its first row, the earliest); this program takes tiles
    # [tile_lo, tile_hi) of those from tile_first on.
    kv_end = tl.minimum(seq_len, context_len + (local_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tile_first = 0
    if SLIDING:
        tile_first = tl.maximum(context_len + local_block * BLOCK_Q - window + 1, 0) // TILE_N
    if SPLIT:
        per_split = tl.cdiv(num_tiles - tile_first, num_splits)
        tile_lo = tile_first + split * per_split
        tile_hi = tl.minimum(num_tiles, tile_lo + per_split)
    else:
        tile_lo = tile_first
        tile_hi = num_tiles

    qk_scale = score_scale * k_scale if QUANT else score_scale
    # running max (log2 domain) and running sum of exp2(s - m_i); a sink joins split 0's
    m_i, l_i = softmax_start(sinks_ptr, row_head, row_ok, split == 0, BLOCK_M, SINKS)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq * stride_bt
    cols = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + cols  # [TILE_N]
        key_ok = key_pos < kv_end
        key_off = key_offsets(table_row, key_pos, key_ok, kv_head, stride_c_blk,
                              stride_c_slot, stride_c_head, BLOCK_SIZE)  # [TILE_N]
        k = tl.load(cache_ptr + key_off[None, :] + dims[:, None],
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)  # [DIM_PAD, TILE_N]
        # An fp8 page converts straight to q's dtype (exact: e4m3 fits in bf16 and fp32);
        # the key scale is folded into the score scale (QK_SCALE) instead of the tile.
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = soft_cap(s, softcap_log2)
        # s: [BLOCK_M, TILE_N]
        visible = key_ok[None, :] & (key_pos[None, :] <= row_pos[:, None])
        if SLIDING:
            visible = visible & (key_pos[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
        v = tl.load(cache_ptr + stride_c_kv + key_off[:, None] + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE_N, DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    if QUANT:  # the value scale, applied once to the weighted sum (merging is linear)
        acc = acc * v_scale

    if SPLIT:
        # partials: acc [num_tokens, num_heads, num_splits, DIM_PAD], (m, l) [..., 2]
        part = (row_tok * num_heads + row_head) * num_splits + split  # [BLOCK_M]
        store_partial(part_acc_ptr, part_ml_ptr, part, acc, m_i, l_i, row_ok, DIM_PAD)
    else:
        store_normalized(out_ptr, row_tok * stride_o_tok + row_head * stride_o_head, acc, l_i,
                         row_ok[:, None] & dim_ok[None, :], DIM_PAD)


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, query_start_ptr,
    num_seqs, num_splits, num_heads, head_dim, stride_o_tok, stride_o_head,
    SPLITS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(query_start_ptr + num_seqs):  # a padding row past the last request
        return
    merge_partials(part_acc_ptr, part_ml_ptr, out_ptr, tok, head, num_heads, num_splits,
                   num_splits, tok * stride_o_tok + head * stride_o_head, head_dim,
                   SPLITS_PAD, DIM_PAD)


@dataclass(frozen=True)
class AttentionKernelConfig:
    """Launch shape of ``_paged_attention_kernel``."""

    block_m: int  # rows per program: query tokens x heads of one KV group
    tile_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int


def default_config(max_query_len: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, fp8: bool = False) -> AttentionKernelConfig:
    """Decode batches get 16-row blocks (one token's head group, padded for the tensor
    cores); batches with prefill rows get 64-row blocks so keys are reused across tokens.
    A decode over fp8 pages takes 128-key tiles: converting each 1-byte tile costs more
    than loading it, and the longer tile amortizes that best (docs/perf-log/gpu-dense.md,
    "KV-cache features, re-measured")."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    dim_pad = triton.next_power_of_2(head_dim)
    if max_query_len <= 1:
        return AttentionKernelConfig(block_m=max(16, group_pad),
                                     tile_n=(128 if fp8 else 64) if dim_pad <= 128 else 32,
                                     num_warps=4, num_stages=3)
    return AttentionKernelConfig(block_m=max(64, group_pad), tile_n=64 if dim_pad <= 128 else 32,
                                 num_warps=4 if dim_pad <= 128 else 8, num_stages=2)


@functools.lru_cache(maxsize=8)
def num_multiprocessors(device: torch.device) -> int:
    """Multiprocessors of a CUDA device, which the split-KV rule sizes the grid for."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU runs kernels through Triton's interpreter: any small count will do


def partial_buffers(out: torch.Tensor, rows: int, num_heads: int, num_splits: int,
                    dim_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partials for ``rows`` query tokens: float32 sums [rows, num_heads,
    num_splits, dim_pad] and (max, sum) [..., 2]; without splits nothing is allocated and
    ``out`` stands in for both (the kernels do not touch them then)."""
    if num_splits == 1:
        return out, out
    acc = torch.empty((rows, num_heads, num_splits, dim_pad), dtype=torch.float32,
                      device=out.device)
    ml = torch.empty((rows, num_heads, num_splits, 2), dtype=torch.float32, device=out.device)
    return acc, ml


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split-KV rule: enough splits that ``num_programs`` (query blocks x KV heads) becomes
    about PROGRAMS_PER_SM programs per multiprocessor, but no split shorter than
    MIN_TOKENS_PER_SPLIT keys and at most MAX_SPLITS; a power of two (few compiled variants)."""
    want = -(-PROGRAMS_PER_SM * num_sms // max(num_programs, 1))
    cap = min(MAX_SPLITS, max(1, max_seq_len // MIN_TOKENS_PER_SPLIT))
    splits = max(1, min(want, cap))
    return 1 << (splits.bit_length() - 1)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, *, scale: float, max_query_len: int,
                    max_seq_len: int, num_splits: int | None = None,
                    config: AttentionKernelConfig | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    sliding_window: int | None = None,
                    logit_softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every request's new queries over its cached keys and values.

    q, out: [num_tokens, num_heads, head_dim] (rows past ``query_start_loc[-1]`` are
    padding and left untouched); kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim]; query_start_loc: [num_seqs + 1] int32; seq_lens: [num_seqs] int32;
    block_tables: [num_seqs, max_blocks] int32. ``max_query_len`` and ``max_seq_len``
    bound the batch's query lengths and sequence lengths (the host knows them); they
    pick the kernel variant and the split count, never the result. ``num_splits`` fixes
    the split count (a CUDA graph needs the same one on every replay). An fp8 cache is
    read as ``page * k_scale`` / ``page * v_scale``. ``sliding_window`` W limits the query
    at position p to the keys at p - W + 1 .. p; ``logit_softcap`` c turns each score s
    into c * tanh(s / c); ``sinks`` [num_heads] (float, q's device) join each query's
    softmax denominator. Returns ``out``.
    """
    _check_attention_args(q, kv_cache, out, query_start_loc, seq_lens, block_tables)
    check_features(sliding_window, logit_softcap, sinks, q.shape[1], q.device)
    quant = kv_cache.dtype == FP8_KV_DTYPE
    if quant:
        _check_scales(k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    cfg = config or default_config(max_query_len, num_heads, num_kv_heads, head_dim, quant)
    group_pad = triton.next_power_of_2(group)
    if cfg.block_m < group_pad or cfg.block_m % group_pad:
        raise ValueError(f"block_m {cfg.block_m} must be a multiple of the padded head "
                         f"group {group_pad}")
    block_q = cfg.block_m // group_pad
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_splits is None:
        busy_blocks = max(num_seqs, min(num_q_blocks, num_tokens // block_q))
        # a query block's keys: a window's worth past its first query, at most
        span = max_seq_len
        if sliding_window is not None:
            span = min(span, sliding_window + min(block_q, max_query_len) - 1)
        num_splits = choose_num_splits(busy_blocks * num_kv_heads, span,
                                       num_multiprocessors(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    dim_pad = triton.next_power_of_2(head_dim)
    part_acc, part_ml = partial_buffers(out, num_tokens, num_heads, num_splits, dim_pad)
    score_scale, softcap_log2 = score_scales(scale, logit_softcap)
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        q, kv_cache, out, part_acc, part_ml,
        query_start_loc, seq_lens, block_tables, q if sinks is None else sinks,
        score_scale, float(k_scale), float(v_scale), sliding_window or 0, softcap_log2,
        num_seqs, num_splits, num_heads, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n, DIM_PAD=dim_pad, BLOCK_SIZE=block_size, SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANT=quant,
        SLIDING=sliding_window is not None, SOFTCAP=logit_softcap is not None,
        SINKS=sinks is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q.device),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, query_start_loc,
            num_seqs, num_splits, num_heads, head_dim, out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits), DIM_PAD=dim_pad, num_warps=4,
            **pdl_args(q.device),
        )
    return out


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                        sliding_window: int | None = None,
                        logit_softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference for ``paged_attention``: per request, gather its blocks and run
    masked softmax attention in fp32 (an fp8 cache dequantized as page * scale), with the
    window, the softcap and the sinks (a column of the softmax, dropped after it) when
    given. Rows past the last request come back as zeros."""
    quant = kv_cache.dtype == FP8_KV_DTYPE
    out = torch.zeros_like(q)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end == q_start:
            continue
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        # [2, n_blocks, block_size, kv_heads, head_dim] -> [2, seq_len, heads, head_dim]
        kv = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len].float()
        if quant:
            kv[0] *= k_scale
            kv[1] *= v_scale
        kv = kv.repeat_interleave(group, dim=2)
        query = q[q_start:q_end].float()  # [q_len, heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", query, kv[0]) * scale
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
        behind = q_pos[:, None] - torch.arange(seq_len, device=q.device)[None, :]
        visible = behind >= 0  # [q_len, seq_len]
        if sliding_window is not None:
            visible &= behind < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))  # [heads, q_len, seq_len]
        if sinks is not None:
            column = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            weights = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        else:
            weights = scores.softmax(-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", weights, kv[1]).to(q.dtype)
    return out


# ---- argument checks -------------------------------------------------------------------

def _check_scales(k_scale: float, v_scale: float) -> None:
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number for an fp8 kv_cache, "
                             f"got {value}")


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache has dtype {kv_cache.dtype}; the Triton attention kernels "
                         f"take float32, bfloat16, float16 or float8_e4m3fn (fp8) caches")
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be contiguous in head_dim, got strides "
                         f"{kv_cache.stride()}")
    if kv_cache.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {kv_cache.shape[-1]} is over the kernels' limit "
                         f"of {MAX_HEAD_DIM}")


def _check_attention_args(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor) -> None:
    _check_cache(kv_cache)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [num_tokens, num_heads, {head_dim}] to match kv_cache "
                         f"{tuple(kv_cache.shape)}, got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's "
                         f"{num_kv_heads} KV heads")
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    for name, t in (("q", q), ("out", out)):
        check_float(name, t, "Triton attention kernels")
        check_same_device(name, t, kv_cache, "kv_cache")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, shape in (("query_start_loc", query_start_loc, (num_seqs + 1,)),
                           ("seq_lens", seq_lens, (num_seqs,)),
                           ("block_tables", block_tables, (num_seqs, block_tables.shape[-1]))):
        if tuple(t.shape) != shape or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 of shape {shape} for {num_seqs} "
                             f"requests, got {t.dtype} {tuple(t.shape)}")
        check_same_device(name, t, kv_cache, "kv_cache")
    if block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dimension, got strides "
                         f"{block_tables.stride()}")
