"""The runner's one input path: persistent device buffers that every step reads, filled by
one pinned copy per step.

A step's per-token and per-request inputs are written into a pinned host buffer in the
packed layout of ``vllmpy.ops.step_inputs`` (padded to the step's shape: the graph's size,
or the step's own for an eager step), copied to the device in one transfer, and unpacked
there into ``tensors`` (the ids, positions, slots, sequence lengths, query starts and
logits rows the model and the sampler read) by one launch, which a CUDA graph captures as
its first kernel. The block tables go to their own persistent buffer, copied only when
they differ from what it already holds (a request gets a new block every block_size
tokens). ``sampled`` holds the last step's sampled ids on the device: a token the host
does not know yet is read from there by the unpack (``fill``).

Eager steps, mixed CUDA graphs and decode CUDA graphs all take their inputs this way; on
the CPU the host buffer is the device buffer and the unpack is PyTorch's.
"""

from __future__ import annotations

import numpy as np
import torch

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.ops.step_inputs import (
    StepTensors,
    layout,
    packed_size,
    unpack_step_inputs_ref,
)
from vllmpy.worker.input_batch import StepInputs


class StepBuffers:
    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int,
                 max_blocks: int, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        cuda = device.type == "cuda"
        size = packed_size(max_tokens, max_seqs)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
        self.packed = torch.zeros(size, dtype=torch.int32, device=device) if cuda else self.host
        self.tensors = StepTensors(max_tokens, max_seqs, device)
        self.block_tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32,
                                        device=device)
        self._tables_host = torch.zeros(max_seqs * max_blocks, dtype=torch.int32,
                                        pin_memory=cuda)
        # the [rows, width] block tables last copied into block_tables (None: unknown)
        self._tables: np.ndarray | None = None
        self.sampled = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        # Hybrid models (``enable_seats``): each request's recurrent-state seat; padding
        # requests get the scratch seat (num_seats). None without recurrent layers.
        self.num_seats = 0
        self.state_indices: torch.Tensor | None = None
        self._seats_host: torch.Tensor | None = None
        self._seats_cpu: list[int] = []
        if cuda:
            from vllmpy.ops.step_inputs import unpack_step_inputs

            self._unpack = unpack_step_inputs
        else:
            self._unpack = unpack_step_inputs_ref

    def enable_seats(self, num_seats: int) -> None:
        """Carry each step's recurrent-state seats (``AttentionMetadata.state_indices``)."""
        cuda = self.device.type == "cuda"
        self.num_seats = num_seats
        self._seats_host = torch.full((self.max_seqs,), num_seats, dtype=torch.int32,
                                      pin_memory=cuda)
        self.state_indices = (torch.full((self.max_seqs,), num_seats, dtype=torch.int32,
                                         device=self.device) if cuda else self._seats_host)

    @property
    def max_tokens(self) -> int:
        return self.tensors.max_tokens

    @property
    def max_seqs(self) -> int:
        return self.tensors.max_seqs

    def stage(self, step: StepInputs, tokens: int, seqs: int,
              fill: np.ndarray | None = None, decode: bool = False) -> None:
        """Write ``step`` padded to ``tokens`` x ``seqs`` and start its copies. Padding
        tokens store nothing (slot -1); padding requests have no keys (length 0) and, in a
        ``decode`` step, one padding query each (token i is request i), else none.
        ``fill[i]`` >= 0: token i is that row of ``sampled``. The caller keeps the host
        buffers until the copies have run (an event recorded after this call)."""
        n, r = step.num_tokens, len(step.seq_lens)
        if n > tokens or r > seqs:
            raise ValueError(f"a step of {n} tokens and {r} requests does not fit a "
                             f"{tokens} x {seqs} shape")
        host = self.host.numpy()
        lay = layout(tokens, seqs)

        def put(name: str, values: np.ndarray | None, pad: int) -> None:
            offset, length = lay[name]
            k = 0 if values is None else len(values)
            if k:
                host[offset:offset + k] = values
            host[offset + k:offset + length] = pad

        put("ids", step.input_ids, 0)
        put("positions", step.positions, 0)
        put("slots", step.slot_mapping, -1)
        put("fill", fill, -1)
        put("seq_lens", step.seq_lens, 0)
        offset, length = lay["query_start_loc"]
        host[offset:offset + r + 1] = step.query_start_loc
        host[offset + r + 1:offset + length] = (np.arange(r + 1, length) if decode else n)
        put("logits_indices", step.logits_indices, 0)
        used = packed_size(tokens, seqs)
        if self.packed is not self.host:
            self.packed[:used].copy_(self.host[:used], non_blocking=True)
        self._copy_tables(step.block_tables)
        if self.state_indices is not None:
            self._copy_seats(step.state_indices, seqs)

    def _copy_seats(self, seats: np.ndarray | None, rows: int) -> None:
        assert self._seats_host is not None and self.state_indices is not None
        host = self._seats_host.numpy()
        k = 0 if seats is None else len(seats)
        host[:k] = seats if seats is not None else ()
        host[k:rows] = self.num_seats
        self._seats_cpu = host[:rows].tolist()
        if self.state_indices is not self._seats_host:
            self.state_indices[:rows].copy_(self._seats_host[:rows], non_blocking=True)

    def stage_padding(self, tokens: int, seqs: int, decode: bool = False) -> None:
        """A step of padding only (``tokens`` x ``seqs``), as graphs are warmed up and
        captured on: nothing is stored or attended."""
        empty = np.zeros(0, dtype=np.int64)
        step = StepInputs(input_ids=empty, positions=empty, slot_mapping=empty,
                          query_start_loc=np.zeros(1, dtype=np.int32),
                          seq_lens=np.zeros(0, dtype=np.int32),
                          block_tables=np.zeros((0, 1), dtype=np.int32),
                          logits_indices=empty, sample_rows=[], max_query_len=0,
                          max_seq_len=0)
        self.stage(step, tokens, seqs, decode=decode)

    def _copy_tables(self, tables: np.ndarray) -> None:
        if not tables.size:
            return
        if self._tables is not None and np.array_equal(self._tables, tables):
            return
        rows, width = tables.shape
        staged = self._tables_host[:rows * width].view(rows, width)
        staged.numpy()[:] = tables
        self.block_tables[:rows, :width].copy_(staged, non_blocking=True)
        self._tables = np.array(tables, dtype=np.int32, copy=True)

    def unpack(self, tokens: int, seqs: int) -> None:
        """On the device: the staged step into ``tensors`` (a graph's first kernel)."""
        self._unpack(self.packed, self.sampled, self.tensors, tokens, seqs)

    def metadata(self, tokens: int, seqs: int, query_start_loc: list[int],
                 seq_lens: list[int], max_query_len: int, max_seq_len: int,
                 num_actual_tokens: int | None = None) -> AttentionMetadata:
        """Attention metadata over the buffers for a ``tokens`` x ``seqs`` shape, with the
        host copies given (a graph's are fixed at capture)."""
        t = self.tensors
        return AttentionMetadata(
            num_actual_tokens=tokens if num_actual_tokens is None else num_actual_tokens,
            query_start_loc=t.query_start_loc[:seqs + 1],
            query_start_loc_cpu=query_start_loc,
            seq_lens=t.seq_lens[:seqs],
            seq_lens_cpu=seq_lens,
            slot_mapping=t.slot_mapping[:tokens],
            block_tables=self.block_tables[:seqs],
            block_size=self.block_size,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            state_indices=(None if self.state_indices is None
                           else self.state_indices[:seqs]),
            state_indices_cpu=(None if self.state_indices is None
                               else self._seats_cpu[:seqs]),
        )
