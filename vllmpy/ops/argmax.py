"""Greedy sampling's argmax over a few rows of logits, spread over the whole GPU.

``torch.argmax`` reduces a row of logits in one block, on the critical path of a small
model's decode step (docs/perf-log/gpu-dense.md, "greedy sampling's argmax split over the
GPU"). Here each row is cut into chunks of
``CHUNK`` logits; one launch finds each chunk's largest logit and its first position, a
second picks each row's winner from its chunks. The result is ``torch.argmax``'s: the
first position of the largest value, a NaN counting as larger than any number and -0.0 as
equal to +0.0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float
from vllmpy.ops.pdl import pdl_args, pdl_wait

# logits per program of the first launch (16 KiB of bfloat16)
CHUNK = 8192


@triton.jit
def _ordered(x):
    """fp32 values as int32 keys in the same order (-0.0 equal to +0.0), NaN above +inf."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)  # -0.0 ties with +0.0, as in torch.argmax
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit(do_not_specialize=["vocab", "chunks", "stride_l"])
def _chunk_max_kernel(logits_ptr, key_ptr, pos_ptr, vocab, chunks, stride_l,
                      CHUNK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < vocab
    pdl_wait(PDL)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=ok,
                other=float("-inf")).to(tl.float32)
    key = tl.where(ok, _ordered(x), -0x7FFFFFFF - 1)  # past the row: below every value
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, offs, 0x7FFFFFFF), axis=0)
    tl.store(key_ptr + row * chunks + chunk, best)
    tl.store(pos_ptr + row * chunks + chunk, first)


@triton.jit(do_not_specialize=["chunks"])
def _row_max_kernel(key_ptr, pos_ptr, out_ptr, chunks, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < chunks
    pdl_wait(PDL)
    key = tl.load(key_ptr + row * chunks + offs, mask=ok, other=-0x7FFFFFFF - 1)
    pos = tl.load(pos_ptr + row * chunks + offs, mask=ok, other=0x7FFFFFFF)
    best = tl.max(key, axis=0)
    # chunks are in order, so the smallest position among the best keys is the first
    first = tl.min(tl.where(ok & (key == best), pos, 0x7FFFFFFF), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for logits [rows, vocab] (float32, bfloat16 or
    float16, contiguous in the last dimension); written into ``out`` (int64 [rows], on
    the logits' device) when given, and returned."""
    check_float("logits", logits, "argmax kernels")
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(f"argmax_rows needs logits [rows, vocab > 0] contiguous in the last "
                         f"dimension, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    elif (out.shape != (rows,) or out.dtype != torch.int64 or out.stride(0) != 1
          or out.device != logits.device):
        raise ValueError(f"out must be a contiguous int64 [{rows}] on {logits.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    keys = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    pos = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    pdl = pdl_args(logits.device)
    _chunk_max_kernel[(rows, chunks)](logits, keys, pos, vocab, chunks, logits.stride(0),
                                      CHUNK=CHUNK, num_warps=8, **pdl)
    _row_max_kernel[(rows,)](keys, pos, out, chunks,
                             BLOCK=max(16, triton.next_power_of_2(chunks)), num_warps=1,
                             **pdl)
    return out
