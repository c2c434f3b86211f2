"""Non-causal attention over packed variable-length sequences, in one Triton launch.

An encoder-only (pooling) step holds whole sequences and no KV cache: the step's tokens
are the concatenation of its sequences, and sequence i owns rows
``cu_seqlens[i]:cu_seqlens[i+1]`` of q [num_tokens, num_heads, head_dim] and of k, v
[num_tokens, num_kv_heads, head_dim]. Each query attends to every key of its own
sequence (before and after it) and to no other; query head h reads KV head
``h // (num_heads // num_kv_heads)`` (grouped-query attention, the KV head read in place
rather than repeated in memory).

q, k and v may be strided views whose last dimension is contiguous: a model's fused qkv
projection gives [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] and the three
are column slices of it, so a token's stride is the whole fused row. The kernel takes
each tensor's token and head strides.

Kernel layout (flash attention's forward pass). A program takes BLOCK_M consecutive
queries of one sequence and one query head, and streams that sequence's keys and values
in tiles of BLOCK_N through an fp32 online softmax (scores in the log2 domain: log2(e)
is folded into the score scale, so the kernel exponentiates with exp2). Grid:
(cdiv(max_len, BLOCK_M), num_seqs, num_heads); a program whose block starts past its
sequence's end exits at once. The head dimension is padded to a power of two of at least
16 (a tensor-core dot needs inner dimensions of 16 or more) and masked, so widths such as
80 or 96 work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float, check_same_device
from vllmpy.ops.paged_attention import LOG2E, MAX_HEAD_DIM, online_softmax, store_normalized

BLOCK_M = 64  # queries per program


@triton.jit
def _varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_ptr, score_scale, head_dim,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head, stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DIM_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    seq_start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    if q_block * BLOCK_M >= seq_len:
        return
    kv_head = head // GROUP

    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the sequence
    row_ok = rows < seq_len
    row_tok = (seq_start + rows).to(tl.int64)  # [BLOCK_M] row of q / out
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + row_tok[:, None] * stride_q_tok + head * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, DIM_PAD]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for key_start in range(0, seq_len, BLOCK_N):
        key = key_start + cols  # [BLOCK_N] key index in the sequence
        key_ok = key < seq_len
        key_tok = (seq_start + key).to(tl.int64)
        k = tl.load(k_ptr + key_tok[None, :] * stride_k_tok + kv_head * stride_k_head
                    + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None],
                    other=0.0)  # [DIM_PAD, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * score_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(key_ok[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = online_softmax(s, m_i, l_i)
        v = tl.load(v_ptr + key_tok[:, None] * stride_v_tok + kv_head * stride_v_head
                    + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                    other=0.0)  # [BLOCK_N, DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    store_normalized(out_ptr, row_tok * stride_o_tok + head * stride_o_head, acc, l_i,
                     row_ok[:, None] & dim_ok[None, :], DIM_PAD)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_len: int, scale: float | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Non-causal attention of each packed sequence over its own tokens.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    (num_heads a multiple of num_kv_heads), all of one float dtype and contiguous in
    head_dim; cu_seqlens: [num_seqs + 1] int32 on q's device, the cumulative sequence
    starts (sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]; the last entry should be
    num_tokens). ``max_len`` is the longest sequence, known on the host: it sizes the
    grid, so a smaller value leaves the rows past it unwritten (the launcher cannot check
    it without reading cu_seqlens back from the device). ``scale`` defaults to
    head_dim ** -0.5. ``out`` (q's shape and dtype, contiguous in head_dim; a
    [num_tokens, num_heads * head_dim] buffer viewed as [num_tokens, num_heads, head_dim]
    will do) receives the result; without it one is allocated. Returns the output.
    """
    _check_args(q, k, v, cu_seqlens, max_len, out)
    num_tokens, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0 or max_len == 0:
        return out
    if scale is None:
        scale = head_dim ** -0.5
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_n, num_warps = (64, 4) if dim_pad <= 128 else (32, 8)
    grid = (triton.cdiv(max_len, BLOCK_M), num_seqs, num_heads)
    _varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens, scale * LOG2E, head_dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=num_heads // k.shape[1], BLOCK_M=BLOCK_M, BLOCK_N=block_n, DIM_PAD=dim_pad,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )
    return out


def _check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                max_len: int, out: torch.Tensor | None) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[0] != num_tokens or t.shape[2] != head_dim:
            raise ValueError(f"{name} must be [{num_tokens}, num_kv_heads, {head_dim}] to match "
                             f"q {tuple(q.shape)}, got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    if num_heads % k.shape[1]:
        raise ValueError(f"q has {num_heads} heads, not a multiple of k and v's "
                         f"{k.shape[1]} KV heads")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is over the kernel's limit of {MAX_HEAD_DIM}")
    tensors = [("q", q), ("k", k), ("v", v)] + ([("out", out)] if out is not None else [])
    for name, t in tensors:
        check_float(name, t, "Triton attention kernels")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
        check_same_device(name, t, q, "q")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be a 1-D int32 [num_seqs + 1] tensor, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    check_same_device("cu_seqlens", cu_seqlens, q, "q")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"max_len must be a non-negative int (the longest sequence), "
                         f"got {max_len!r}")
