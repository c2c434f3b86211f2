"""CUDA graphs of the model's decode forward and its logits, for a fixed list of batch sizes sharing one
memory pool.

A decode step (every request computes one token) replays the graph of the smallest
captured size that holds it. The graph reads its inputs from static device buffers; rows
past the real batch are padding: their KV slot is -1 (not stored), their sequence length
0 and their query range empty, so attention skips them and their hidden states are
discarded.
"""

from __future__ import annotations

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model: nn.Module, device: torch.device, max_num_seqs: int,
                 max_model_len: int, block_size: int) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        n = self.sizes[-1]
        width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.arange = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.query_start_loc = self.arange.clone()
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # size -> (hidden states [size, hidden], logits [size, vocab])
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.logits: torch.Tensor | None = None  # [max size, vocab], shared by every size

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        # max_seq_len = max_model_len fixes the kernels' split-KV choice for every replay
        return AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[:size + 1],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens=self.seq_lens[:size],
            seq_lens_cpu=[self.max_model_len] * size,
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one pool. The static buffers hold only
        padding while capturing, so nothing is written to the KV cache."""
        pool = None
        for size in reversed(self.sizes):
            meta = self._meta(size)
            ids, pos = self.input_ids[:size], self.positions[:size]
            # warm-up: compiles kernels, builds rotary tables
            logits = self.model.compute_logits(self.model(ids, pos, meta))  # type: ignore[operator]
            if self.logits is None:  # one logits buffer that every size writes into
                self.logits = torch.empty((self.sizes[-1], logits.shape[1]), dtype=logits.dtype,
                                          device=logits.device)
            del logits
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, pos, meta)
                self.logits[:size].copy_(self.model.compute_logits(hidden))  # type: ignore[operator]
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
            self.outputs[size] = (hidden, self.logits[:size])
        torch.cuda.synchronize()

    def run(self, n: int, input_ids: torch.Tensor, positions: torch.Tensor,
            slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
            fill: tuple[torch.Tensor, torch.Tensor] | None = None,
            copied: torch.cuda.Event | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for a decode step of ``n`` requests; returns (hidden states [n, hidden],
        logits [n, vocab]), views of the graph's outputs that the next replay overwrites.
        The inputs may be pinned host tensors (copied without blocking) or device tensors;
        ``fill`` = (rows, ids) overwrites input ids the host does not know yet; ``copied``
        is recorded once the inputs are copied, before the replay."""
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if fill is not None:  # (rows, ids): tokens that only the device holds yet
            self.input_ids.index_copy_(0, fill[0], fill[1])
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
            self.query_start_loc[n + 1:size + 1].fill_(n)
        self.query_start_loc[:n + 1].copy_(self.arange[:n + 1])
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if copied is not None:
            copied.record()
        self.graphs[size].replay()
        hidden, logits = self.outputs[size]
        return hidden[:n], logits[:n]
