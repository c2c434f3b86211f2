"""A decode graph's inputs from one host copy.

A decode step's per-request inputs travel as one packed int64 buffer ``[5, seqs]``: the
token ids the host knows, positions, KV slots, for each row the row of the previous step's
sampled ids that holds its token (-1 where the host knows it), and sequence lengths. One
copy moves it to the device, and ``unpack_decode_inputs`` (the graph's first kernel)
takes each token id from the host's row or, when the previous step is still in flight,
from that step's sampled ids on the device, and writes the int32 sequence lengths the
attention kernels read. Rows past the step's requests are padding, set by the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# rows of the packed buffer
IDS, POSITIONS, SLOTS, FILL, SEQ_LENS = range(5)
NUM_ROWS = 5


# Rows a program unpacks. One block size and no specialization on the row count keep
# this to one compiled variant for every decode graph's batch size.
BLOCK_ROWS = 128


@triton.jit(do_not_specialize=["size"])
def _unpack_kernel(host_ids_ptr, fill_ptr, lens_ptr, sampled_ptr, ids_ptr, seq_lens_ptr,
                   size, BLOCK: tl.constexpr):
    # host_ids, fill, lens: the packed buffer's rows IDS, FILL and SEQ_LENS
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    host_ids = tl.load(host_ids_ptr + offs, mask=ok, other=0)
    fill = tl.load(fill_ptr + offs, mask=ok, other=-1)
    dev_ids = tl.load(sampled_ptr + tl.maximum(fill, 0), mask=ok & (fill >= 0), other=0)
    tl.store(ids_ptr + offs, tl.where(fill >= 0, dev_ids, host_ids), mask=ok)
    lens = tl.load(lens_ptr + offs, mask=ok, other=0)
    tl.store(seq_lens_ptr + offs, lens.to(tl.int32), mask=ok)


def _check(packed: torch.Tensor, sampled: torch.Tensor, ids: torch.Tensor,
           seq_lens: torch.Tensor, size: int) -> None:
    if packed.dim() != 2 or packed.shape[0] != NUM_ROWS or packed.dtype != torch.int64 \
            or packed.stride(1) != 1:
        raise ValueError(f"packed must be int64 [{NUM_ROWS}, seqs] contiguous in its last "
                         f"dimension, got {packed.dtype} {tuple(packed.shape)}")
    if not 0 <= size <= packed.shape[1]:
        raise ValueError(f"size {size} is outside the packed buffer's {packed.shape[1]} rows")
    for name, t, dtype in (("sampled", sampled, torch.int64), ("ids", ids, torch.int64),
                           ("seq_lens", seq_lens, torch.int32)):
        if t.dim() != 1 or t.dtype != dtype or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous 1-D {dtype}, got {t.dtype} "
                             f"{tuple(t.shape)}")
        if t.device != packed.device:
            raise ValueError(f"{name} is on {t.device}, packed on {packed.device}")
    if ids.shape[0] < size or seq_lens.shape[0] < size:
        raise ValueError(f"ids and seq_lens need {size} rows, got {ids.shape[0]} and "
                         f"{seq_lens.shape[0]}")


def unpack_decode_inputs(packed: torch.Tensor, sampled: torch.Tensor, ids: torch.Tensor,
                         seq_lens: torch.Tensor, size: int) -> None:
    """For the first ``size`` rows: ``ids[i]`` = ``sampled[packed[FILL, i]]`` where that
    row is set (>= 0), else ``packed[IDS, i]``; ``seq_lens[i]`` = ``packed[SEQ_LENS, i]``
    as int32. A fill row must index into ``sampled`` (the caller's contract: the row of
    the previous step's ids that holds the token)."""
    _check(packed, sampled, ids, seq_lens, size)
    if size == 0:
        return
    _unpack_kernel[(triton.cdiv(size, BLOCK_ROWS),)](
        packed[IDS], packed[FILL], packed[SEQ_LENS], sampled, ids, seq_lens, size,
        BLOCK=BLOCK_ROWS)


def unpack_decode_inputs_ref(packed: torch.Tensor, sampled: torch.Tensor, ids: torch.Tensor,
                             seq_lens: torch.Tensor, size: int) -> None:
    """PyTorch reference for ``unpack_decode_inputs``."""
    fill = packed[FILL, :size]
    from_device = sampled[fill.clamp(min=0)]
    ids[:size] = torch.where(fill >= 0, from_device, packed[IDS, :size])
    seq_lens[:size] = packed[SEQ_LENS, :size].to(torch.int32)
