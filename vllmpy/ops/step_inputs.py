"""A step's inputs from one host copy.

Every step (eager, a mixed CUDA graph or a decode graph) sends its per-token and
per-request inputs to the device as one packed int32 buffer, laid out by the step's
(padded) token count ``T`` and request count ``S`` (``layout``):

    ids[T] positions[T] slots[T] fill[T] seq_lens[S] query_start_loc[S + 1] logits_indices[S]

``fill[i]`` is the row of the previous step's sampled ids (still on the device) that holds
token i, or -1 where the host knows it. ``unpack_step_inputs`` (a graph's first kernel,
and the first launch of an eager step) writes them into the persistent buffers the model
reads: the token ids (taken from ``sampled`` where ``fill`` says so), positions, KV slots
and logits rows as int64, the sequence lengths and query starts as int32. The buffer's
offsets depend only on (T, S), so a graph captured for a shape reads the same addresses at
every replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows a program unpacks. One block size and no specialization on the sizes keep this to
# one compiled variant for every step shape.
BLOCK_ROWS = 256


def layout(tokens: int, seqs: int) -> dict[str, tuple[int, int]]:
    """name -> (offset, length) in the packed buffer of a ``tokens`` x ``seqs`` step."""
    t, s = tokens, seqs
    return {"ids": (0, t), "positions": (t, t), "slots": (2 * t, t), "fill": (3 * t, t),
            "seq_lens": (4 * t, s), "query_start_loc": (4 * t + s, s + 1),
            "logits_indices": (4 * t + 2 * s + 1, s)}


def packed_size(tokens: int, seqs: int) -> int:
    return 4 * tokens + 3 * seqs + 1


@triton.jit(do_not_specialize=["tokens", "seqs"])
def _unpack_kernel(packed_ptr, sampled_ptr, ids_ptr, pos_ptr, slots_ptr, seq_lens_ptr,
                   qsl_ptr, logits_ptr, tokens, seqs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tok = offs < tokens
    host_ids = tl.load(packed_ptr + offs, mask=tok, other=0)
    fill = tl.load(packed_ptr + 3 * tokens + offs, mask=tok, other=-1)
    dev_ids = tl.load(sampled_ptr + tl.maximum(fill, 0), mask=tok & (fill >= 0), other=0)
    tl.store(ids_ptr + offs, tl.where(fill >= 0, dev_ids, host_ids.to(tl.int64)), mask=tok)
    pos = tl.load(packed_ptr + tokens + offs, mask=tok, other=0)
    tl.store(pos_ptr + offs, pos.to(tl.int64), mask=tok)
    slots = tl.load(packed_ptr + 2 * tokens + offs, mask=tok, other=-1)
    tl.store(slots_ptr + offs, slots.to(tl.int64), mask=tok)
    seq = offs < seqs
    base = 4 * tokens
    tl.store(seq_lens_ptr + offs, tl.load(packed_ptr + base + offs, mask=seq, other=0),
             mask=seq)
    starts = offs < seqs + 1
    tl.store(qsl_ptr + offs, tl.load(packed_ptr + base + seqs + offs, mask=starts, other=0),
             mask=starts)
    rows = tl.load(packed_ptr + base + 2 * seqs + 1 + offs, mask=seq, other=0)
    tl.store(logits_ptr + offs, rows.to(tl.int64), mask=seq)


class StepTensors:
    """The persistent buffers ``unpack_step_inputs`` writes (sized for the largest step)."""

    def __init__(self, max_tokens: int, max_seqs: int, device: torch.device) -> None:
        def buf(n: int, dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return torch.full((n,), fill, dtype=dtype, device=device)

        self.input_ids = buf(max_tokens, torch.int64)
        self.positions = buf(max_tokens, torch.int64)
        self.slot_mapping = buf(max_tokens, torch.int64, -1)
        self.seq_lens = buf(max_seqs, torch.int32)
        self.query_start_loc = buf(max_seqs + 1, torch.int32)
        self.logits_indices = buf(max_seqs, torch.int64)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs


def _check(packed: torch.Tensor, sampled: torch.Tensor, out: StepTensors, tokens: int,
           seqs: int) -> None:
    if packed.dim() != 1 or packed.dtype != torch.int32 or packed.stride(0) != 1:
        raise ValueError(f"packed must be a contiguous 1-D int32, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    if packed.shape[0] < packed_size(tokens, seqs):
        raise ValueError(f"packed holds {packed.shape[0]} values, a step of {tokens} tokens "
                         f"and {seqs} requests needs {packed_size(tokens, seqs)}")
    if not (0 <= tokens <= out.max_tokens and 0 <= seqs <= out.max_seqs):
        raise ValueError(f"a step of {tokens} tokens and {seqs} requests does not fit buffers "
                         f"of {out.max_tokens} tokens and {out.max_seqs} requests")
    if sampled.dim() != 1 or sampled.dtype != torch.int64 or sampled.device != packed.device:
        raise ValueError(f"sampled must be a 1-D int64 on {packed.device}, got "
                         f"{sampled.dtype} {tuple(sampled.shape)} on {sampled.device}")


def unpack_step_inputs(packed: torch.Tensor, sampled: torch.Tensor, out: StepTensors,
                       tokens: int, seqs: int) -> None:
    """Unpack a ``tokens`` x ``seqs`` step (``layout``) from ``packed`` into ``out``. A fill
    row must index into ``sampled`` (the row of the previous step's ids holding the token)."""
    _check(packed, sampled, out, tokens, seqs)
    grid = (triton.cdiv(max(tokens, seqs + 1), BLOCK_ROWS),)
    _unpack_kernel[grid](packed, sampled, out.input_ids, out.positions, out.slot_mapping,
                         out.seq_lens, out.query_start_loc, out.logits_indices, tokens, seqs,
                         BLOCK=BLOCK_ROWS)


def unpack_step_inputs_ref(packed: torch.Tensor, sampled: torch.Tensor, out: StepTensors,
                           tokens: int, seqs: int) -> None:
    """PyTorch version of ``unpack_step_inputs`` (the CPU's, and the kernel's reference)."""
    _check(packed, sampled, out, tokens, seqs)
    part = {name: packed[o:o + n] for name, (o, n) in layout(tokens, seqs).items()}
    fill = part["fill"]
    ids = part["ids"].long()
    if bool((fill >= 0).any()):
        ids = torch.where(fill >= 0, sampled[fill.clamp(min=0).long()], ids)
    out.input_ids[:tokens] = ids
    out.positions[:tokens] = part["positions"]
    out.slot_mapping[:tokens] = part["slots"]
    out.seq_lens[:seqs] = part["seq_lens"]
    out.query_start_loc[:seqs + 1] = part["query_start_loc"]
    out.logits_indices[:seqs] = part["logits_indices"]
