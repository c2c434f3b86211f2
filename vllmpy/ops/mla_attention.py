"""Multi-head latent attention (MLA) over the paged latent cache: Triton kernels, their
launchers and PyTorch references.

The latent cache of one layer is [num_blocks, block_size, kv_lora_rank + rope_dim]; slot
s is token ``s % block_size`` of block ``s // block_size``. Each token keeps one row for
every head: its normalised latent ``c_kv`` (the first kv_lora_rank values) and its rotated
shared key ``k_pe`` (the last rope_dim).

``write_latents`` stores a step's new rows at their slots.

``absorbed_attention`` is MLA with the up-projections absorbed: each query head brings
``q_lat`` (its no-rope query taken into the latent space through W_UK, [kv_lora_rank]) and
its rotated ``q_pe`` [rope_dim]; the score of a cached token is
``scale * (q_lat . c_kv + q_pe . k_pe)`` and the output is the softmax-weighted sum of the
``c_kv`` rows, [kv_lora_rank] per head (the caller takes it out through W_UV). Every
head reads the same cached rows, so the kernel is multi-query attention whose keys are the
whole rows and whose values are their latent part: one load of a tile serves both dots.

Kernel layout, as ``vllmpy.ops.paged_attention``'s: a program takes one *query block*
(BLOCK_Q consecutive query tokens of one request times BLOCK_H query heads, flattened
into BLOCK_M rows so that a tensor-core dot applies to a single decode token) and streams
that request's rows in tiles of TILE_N tokens through an fp32 online softmax. Grid:
(num_tokens // BLOCK_Q + num_seqs, cdiv(num_heads, BLOCK_H), num_splits); a program finds
its request by binary search over ``query_start_loc`` and exits when its block lies past
the request's queries. Query j of a request of q_len queries sits at position
``seq_len - q_len + j`` and sees the rows up to there, so the kernel takes any mix of
decodes, chunks and prefills. ``max_query_len_absorbed`` lets a caller keep longer
requests for another path: their programs exit at once and their rows are left as they
were. Split-KV (a few long decodes) cuts each query block's rows into ``num_splits`` runs
and merges the partials in a second kernel, as ``paged_attention`` does.

fp8 cache. A cache of ``torch.float8_e4m3fn`` holds ``clamp(x / kv_scale, +-448)``, one
scale per layer for the whole row; the kernel converts a tile to the query's dtype
(exact), folds the scale into the score scale and applies it once to the weighted sum.

Every size the kernels need is a device tensor or a launcher argument the host knows, so
the launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float, check_same_device
from vllmpy.ops.paged_attention import (
    LOG2E,
    choose_num_splits,
    key_offsets,
    merge_partials,
    num_multiprocessors,
    online_softmax,
    owning_request,
    partial_buffers,
    store_normalized,
    store_partial,
)
from vllmpy.ops.pdl import pdl_args, pdl_wait

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = tl.constexpr(448.0)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_KV_DTYPE)
MAX_LATENT_DIM = 1024  # kv_lora_rank + rope_dim; DeepSeek's is 576


# ---- write_latents ---------------------------------------------------------------------

@triton.jit
def _write_latents_kernel(c_ptr, pe_ptr, cache_ptr, slot_ptr, kv_scale,
                          stride_c_tok, stride_pe_tok, stride_blk, stride_slot,
                          kv_lora_rank, rope_dim, BLOCK_SIZE: tl.constexpr,
                          LAT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
                          QUANT: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # a padding token (CUDA graph batch padding): nothing to store
        return
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_slot
    lat = tl.arange(0, LAT_PAD)
    rope = tl.arange(0, ROPE_PAD)
    c = tl.load(c_ptr + tok * stride_c_tok + lat, mask=lat < kv_lora_rank)
    pe = tl.load(pe_ptr + tok * stride_pe_tok + rope, mask=rope < rope_dim)
    if QUANT:  # IEEE division, as torch's, saturating at +-448
        c = tl.minimum(tl.maximum(tl.div_rn(c.to(tl.float32), kv_scale), -FP8_MAX), FP8_MAX)
        pe = tl.minimum(tl.maximum(tl.div_rn(pe.to(tl.float32), kv_scale), -FP8_MAX),
                        FP8_MAX)
    tl.store(dst + lat, c.to(cache_ptr.dtype.element_ty), mask=lat < kv_lora_rank)
    tl.store(dst + kv_lora_rank + rope, pe.to(cache_ptr.dtype.element_ty),
             mask=rope < rope_dim)


def write_latents(c_kv: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                  slot_mapping: torch.Tensor, kv_scale: float = 1.0) -> None:
    """Store c_kv [num_tokens, kv_lora_rank] and k_pe [num_tokens, rope_dim] into
    ``cache`` [num_blocks, block_size, kv_lora_rank + rope_dim] at ``slot_mapping``
    ([num_tokens], int32 or int64); a negative slot skips its token. An fp8 cache stores
    ``clamp(x / kv_scale, +-448)``."""
    _check_cache(cache)
    n = c_kv.shape[0]
    for name, t in (("c_kv", c_kv), ("k_pe", k_pe)):
        if t.dim() != 2 or t.shape[0] != n or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [num_tokens, dim], contiguous in dim, with "
                             f"c_kv's {n} tokens; got {tuple(t.shape)} strides {t.stride()}")
        check_float(name, t, "MLA kernels")
        check_same_device(name, t, cache, "cache")
    kv_lora_rank, rope_dim = c_kv.shape[1], k_pe.shape[1]
    if kv_lora_rank + rope_dim != cache.shape[2]:
        raise ValueError(f"c_kv ({kv_lora_rank}) and k_pe ({rope_dim}) widths must add up to "
                         f"the cache rows' {cache.shape[2]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != n or slot_mapping.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64 [{n}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    check_same_device("slot_mapping", slot_mapping, cache, "cache")
    quant = cache.dtype == FP8_KV_DTYPE
    if quant:
        _check_scale(kv_scale)
    if n == 0:
        return
    _write_latents_kernel[(n,)](
        c_kv, k_pe, cache, slot_mapping, float(kv_scale), c_kv.stride(0), k_pe.stride(0),
        cache.stride(0), cache.stride(1), kv_lora_rank, rope_dim,
        BLOCK_SIZE=cache.shape[1], LAT_PAD=triton.next_power_of_2(kv_lora_rank),
        ROPE_PAD=triton.next_power_of_2(rope_dim), QUANT=quant)


def write_latents_ref(c_kv: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_scale: float = 1.0) -> None:
    """PyTorch reference for ``write_latents``."""
    keep = slot_mapping >= 0
    rows = torch.cat([c_kv, k_pe], dim=-1)[keep]
    slots = slot_mapping[keep].long()
    flat = cache.view(-1, cache.shape[-1])  # [num_slots, latent_dim]
    if cache.dtype == FP8_KV_DTYPE:
        rows = (rows.float() / kv_scale).clamp(-FP8_MAX.value, FP8_MAX.value).to(FP8_KV_DTYPE)
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)  # no fp8 index_copy_
    flat.index_copy_(0, slots, rows.to(flat.dtype))


# ---- absorbed_attention ----------------------------------------------------------------

@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt", "max_absorbed"])
def _absorbed_attention_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    query_start_ptr, seq_lens_ptr, block_table_ptr,
    score_scale, kv_scale, max_absorbed,
    num_seqs, num_splits, num_heads, kv_lora_rank, rope_dim,
    stride_ql_tok, stride_ql_head, stride_qp_tok, stride_qp_head,
    stride_o_tok, stride_o_head, stride_c_blk, stride_c_slot, stride_bt,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, LAT_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    q_block = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    seq, q_start, q_len, local_block = owning_request(query_start_ptr, num_seqs, q_block,
                                                      BLOCK_Q)
    if local_block * BLOCK_Q >= q_len or q_len > max_absorbed:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r of the block is query token r // BLOCK_H of the block, head r % BLOCK_H of
    # this program's heads.
    rows = tl.arange(0, BLOCK_M)
    row_q = local_block * BLOCK_Q + rows // BLOCK_H  # [BLOCK_M] query index in the request
    row_head = head_block * BLOCK_H + rows % BLOCK_H  # [BLOCK_M] query head
    row_ok = (row_q < q_len) & (row_head < num_heads)
    row_pos = context_len + row_q  # [BLOCK_M] position in the sequence
    row_tok = (q_start + row_q).to(tl.int64)
    lat = tl.arange(0, LAT_PAD)
    lat_ok = lat < kv_lora_rank
    rope = tl.arange(0, ROPE_PAD)
    rope_ok = rope < rope_dim
    q_lat = tl.load(q_lat_ptr + row_tok[:, None] * stride_ql_tok
                    + row_head[:, None] * stride_ql_head + lat[None, :],
                    mask=row_ok[:, None] & lat_ok[None, :], other=0.0)  # [BLOCK_M, LAT_PAD]
    q_pe = tl.load(q_pe_ptr + row_tok[:, None] * stride_qp_tok
                   + row_head[:, None] * stride_qp_head + rope[None, :],
                   mask=row_ok[:, None] & rope_ok[None, :], other=0.0)  # [BLOCK_M, ROPE_PAD]

    # Rows at positions [0, kv_end) are visible to some row of the block; this program
    # takes tiles [tile_lo, tile_hi) of them.
    kv_end = tl.minimum(seq_len, context_len + (local_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if SPLIT:
        per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = split * per_split
        tile_hi = tl.minimum(num_tiles, tile_lo + per_split)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    qk_scale = score_scale * kv_scale if QUANT else score_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, LAT_PAD], tl.float32)
    table_row = block_table_ptr + seq * stride_bt
    cols = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + cols  # [TILE_N]
        key_ok = key_pos < kv_end
        row_off = key_offsets(table_row, key_pos, key_ok, 0, stride_c_blk, stride_c_slot,
                              0, BLOCK_SIZE)  # [TILE_N]
        # one load of the latents serves as keys and as values
        c = tl.load(cache_ptr + row_off[:, None] + lat[None, :],
                    mask=key_ok[:, None] & lat_ok[None, :], other=0.0).to(q_lat.dtype)
        pe = tl.load(cache_ptr + row_off[:, None] + kv_lora_rank + rope[None, :],
                     mask=key_ok[:, None] & rope_ok[None, :], other=0.0).to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION) * qk_scale
        # s: [BLOCK_M, TILE_N]
        visible = key_ok[None, :] & (key_pos[None, :] <= row_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(q_lat.dtype), c,
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    if QUANT:  # the scale of the latents as values, once on the weighted sum
        acc = acc * kv_scale

    if SPLIT:
        # partials: acc [num_tokens, num_heads, num_splits, LAT_PAD], (m, l) [..., 2]
        part = (row_tok * num_heads + row_head) * num_splits + split  # [BLOCK_M]
        store_partial(part_acc_ptr, part_ml_ptr, part, acc, m_i, l_i, row_ok, LAT_PAD)
    else:
        store_normalized(out_ptr, row_tok * stride_o_tok + row_head * stride_o_head, acc, l_i,
                         row_ok[:, None] & lat_ok[None, :], LAT_PAD)


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "max_absorbed"])
def _merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, query_start_ptr, max_absorbed,
                  num_seqs, num_splits, num_heads, kv_lora_rank, stride_o_tok,
                  stride_o_head, SPLITS_PAD: tl.constexpr, LAT_PAD: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(query_start_ptr + num_seqs):  # a padding row past the last request
        return
    # the request of this row (the last i with query_start[i] <= tok): skipped ones' rows
    # have no partials
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        right = tl.load(query_start_ptr + mid) <= tok
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    if tl.load(query_start_ptr + lo) - tl.load(query_start_ptr + lo - 1) > max_absorbed:
        return
    merge_partials(part_acc_ptr, part_ml_ptr, out_ptr, tok, head, num_heads, num_splits,
                   num_splits, tok * stride_o_tok + head * stride_o_head, kv_lora_rank,
                   SPLITS_PAD, LAT_PAD)


@dataclass(frozen=True)
class MLAKernelConfig:
    """Launch shape of ``_absorbed_attention_kernel``."""

    block_h: int  # query heads per program
    block_m: int  # rows per program: query tokens x heads
    tile_n: int  # cached rows per loop iteration
    num_warps: int
    num_stages: int


def default_config(max_query_len: int, num_heads: int, latent_dim: int) -> MLAKernelConfig:
    """Decodes get 16 rows of heads (one token, padded for the tensor cores); steps with
    longer queries 32 rows of tokens x heads, so a tile serves several tokens. The fp32
    accumulator is [rows, kv_lora_rank]: wide latents take short tiles and more warps."""
    block_h = min(16, triton.next_power_of_2(num_heads))
    wide = latent_dim > 256
    if max_query_len <= 1:
        return MLAKernelConfig(block_h, 16, 32 if wide else 64, 4, 2)
    return MLAKernelConfig(block_h, 32, 32 if wide else 64, 8 if wide else 4, 2)


def absorbed_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                       out: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor, block_tables: torch.Tensor, *, scale: float,
                       max_query_len: int, max_seq_len: int, kv_scale: float = 1.0,
                       max_query_len_absorbed: int | None = None,
                       num_splits: int | None = None,
                       config: MLAKernelConfig | None = None) -> torch.Tensor:
    """Weight-absorbed MLA of every request's new queries over its cached rows.

    q_lat [num_tokens, num_heads, kv_lora_rank] and q_pe [num_tokens, num_heads, rope_dim]
    (one float dtype, any token and head strides); out [num_tokens, num_heads,
    kv_lora_rank] (rows past ``query_start_loc[-1]`` are padding and left untouched);
    cache [num_blocks, block_size, kv_lora_rank + rope_dim]; query_start_loc
    [num_seqs + 1], seq_lens [num_seqs], block_tables [num_seqs, max_blocks], all int32.
    ``max_query_len`` and ``max_seq_len`` bound the batch's (the host knows them) and pick
    the variant and split count, never the result. Requests of more than
    ``max_query_len_absorbed`` queries (default: none) are skipped, their rows of ``out``
    untouched. ``num_splits`` fixes the split count (CUDA graph replays). Returns ``out``.
    """
    _check_args(q_lat, q_pe, cache, out, query_start_loc, seq_lens, block_tables)
    quant = cache.dtype == FP8_KV_DTYPE
    if quant:
        _check_scale(kv_scale)
    num_tokens, num_heads, kv_lora_rank = q_lat.shape
    rope_dim = q_pe.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = config or default_config(max_query_len, num_heads, cache.shape[2])
    if cfg.block_m % cfg.block_h:
        raise ValueError(f"block_m {cfg.block_m} must be a multiple of block_h {cfg.block_h}")
    block_q = cfg.block_m // cfg.block_h
    head_blocks = triton.cdiv(num_heads, cfg.block_h)
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_splits is None:
        busy = max(num_seqs, min(num_q_blocks, num_tokens // block_q))
        num_splits = choose_num_splits(busy * head_blocks, max_seq_len,
                                       num_multiprocessors(q_lat.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    # tl.dot takes no inner dimension under 16: narrow latents and rope parts are padded
    lat_pad = max(16, triton.next_power_of_2(kv_lora_rank))
    part_acc, part_ml = partial_buffers(out, num_tokens, num_heads, num_splits, lat_pad)
    limit = max_query_len_absorbed if max_query_len_absorbed is not None else num_tokens
    _absorbed_attention_kernel[(num_q_blocks, head_blocks, num_splits)](
        q_lat, q_pe, cache, out, part_acc, part_ml, query_start_loc, seq_lens, block_tables,
        scale * LOG2E, float(kv_scale), limit,
        num_seqs, num_splits, num_heads, kv_lora_rank, rope_dim,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0),
        BLOCK_H=cfg.block_h, BLOCK_Q=block_q, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n,
        LAT_PAD=lat_pad, ROPE_PAD=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_SIZE=cache.shape[1], SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32", QUANT=quant,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q_lat.device))
    if num_splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, query_start_loc, limit, num_seqs, num_splits, num_heads,
            kv_lora_rank, out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits), LAT_PAD=lat_pad, num_warps=4,
            **pdl_args(q_lat.device))
    return out


def absorbed_attention_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float,
                           kv_scale: float = 1.0) -> torch.Tensor:
    """PyTorch reference for ``absorbed_attention``: per request, gather its rows and run
    masked softmax attention in fp32 (an fp8 cache read as page * kv_scale). Rows past the
    last request come back as zeros."""
    num_tokens, num_heads, kv_lora_rank = q_lat.shape
    out = torch.zeros_like(q_lat)
    block_size = cache.shape[1]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end == q_start:
            continue
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        rows = cache[blocks].flatten(0, 1)[:seq_len].float()  # [seq_len, latent_dim]
        if cache.dtype == FP8_KV_DTYPE:
            rows = rows * kv_scale
        query = torch.cat([q_lat[q_start:q_end], q_pe[q_start:q_end]], dim=-1).float()
        scores = torch.einsum("qhd,kd->hqk", query, rows) * scale
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q_lat.device)
        visible = q_pos[:, None] >= torch.arange(seq_len, device=q_lat.device)[None, :]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q_start:q_end] = torch.einsum("hqk,kd->qhd", weights,
                                          rows[:, :kv_lora_rank]).to(q_lat.dtype)
    return out


# ---- argument checks -------------------------------------------------------------------

def _check_scale(kv_scale: float) -> None:
    if not (math.isfinite(kv_scale) and kv_scale > 0):
        raise ValueError(f"kv_scale must be a positive finite number for an fp8 latent "
                         f"cache, got {kv_scale}")


def _check_cache(cache: torch.Tensor) -> None:
    if cache.dim() != 3:
        raise ValueError("the latent cache must be [num_blocks, block_size, kv_lora_rank + "
                         f"rope_dim], got {tuple(cache.shape)}")
    if cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"the latent cache has dtype {cache.dtype}; the MLA kernels take "
                         "float32, bfloat16, float16 or float8_e4m3fn (fp8) caches")
    if cache.stride(-1) != 1:
        raise ValueError(f"the latent cache must be contiguous in its rows, got strides "
                         f"{cache.stride()}")
    if cache.shape[-1] > MAX_LATENT_DIM:
        raise ValueError(f"latent rows of {cache.shape[-1]} values are over the kernels' "
                         f"limit of {MAX_LATENT_DIM}")


def _check_args(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor) -> None:
    _check_cache(cache)
    if q_lat.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"q_lat and q_pe must be [num_tokens, num_heads, dim] of the same "
                         f"tokens and heads, got {tuple(q_lat.shape)} and {tuple(q_pe.shape)}")
    if q_lat.shape[2] + q_pe.shape[2] != cache.shape[2]:
        raise ValueError(f"q_lat ({q_lat.shape[2]}) and q_pe ({q_pe.shape[2]}) widths must "
                         f"add up to the cache rows' {cache.shape[2]}")
    if q_pe.dtype != q_lat.dtype:
        raise ValueError(f"q_lat is {q_lat.dtype} but q_pe is {q_pe.dtype}")
    if out.shape != q_lat.shape:
        raise ValueError(f"out must have q_lat's shape {tuple(q_lat.shape)}, got "
                         f"{tuple(out.shape)}")
    for name, t in (("q_lat", q_lat), ("q_pe", q_pe), ("out", out)):
        check_float(name, t, "MLA kernels")
        check_same_device(name, t, cache, "cache")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides "
                             f"{t.stride()}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    for name, t, shape in (("query_start_loc", query_start_loc, (num_seqs + 1,)),
                           ("seq_lens", seq_lens, (num_seqs,)),
                           ("block_tables", block_tables, (num_seqs, block_tables.shape[-1]))):
        if tuple(t.shape) != shape or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 of shape {shape} for {num_seqs} "
                             f"requests, got {t.dtype} {tuple(t.shape)}")
        check_same_device(name, t, cache, "cache")
    if block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dimension, got "
                         f"strides {block_tables.stride()}")
