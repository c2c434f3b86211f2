"""CUDA graphs of the model's forward, sharing one memory pool: decode graphs (the forward,
its logits and each row's argmax) for a list of batch sizes, and mixed graphs (the forward
alone) for small steps that carry prefill tokens.

A decode step (every request computes one token) replays the decode graph of the smallest
captured size that holds it. A step of at most ``max_mixed_tokens`` tokens that is not a
pure decode (a short prefill chunk, say the few new tokens after a cached prefix, with or
without decodes beside it) replays the mixed graph of the smallest token count that holds
it; its logits are computed after the replay, for the rows that sample. Longer steps run
eagerly: their GPU time dwarfs the launch cost a graph saves.

Every graph reads its inputs from static device buffers; rows past the real batch are
padding: their KV slot is -1 (not stored), their sequence length 0 and their query range
empty, so attention skips them and their hidden states are discarded. A decode step's
per-request inputs go to the device in one copy of a packed buffer (``vllmpy.ops.
step_inputs``), and its block table in a second when it changed since the last decode
step (a request gets a new block every block_size tokens); the graph's first kernel takes
each token id the host does not know yet from the previous step's sampled ids
(``sampled``), which stay on the device. A decode graph ends by writing each row's argmax
there too, so that a step of greedy requests needs no sampler launch after the replay.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.sample.sampler import greedy_ids

# Mixed graphs are captured for these step token counts (up to the step budget). Up to
# 2,048 tokens an eager forward's host time (launching every kernel of every layer) is
# comparable to its GPU time; past it the GPU time dominates.
MIXED_TOKEN_SIZES = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """The mixed-graph token counts a step budget of ``max_num_batched_tokens`` can use."""
    sizes = [s for s in MIXED_TOKEN_SIZES if s < max_num_batched_tokens]
    if max_num_batched_tokens <= MIXED_TOKEN_SIZES[-1]:
        sizes.append(max_num_batched_tokens)
    return sizes


class StepGraphs:
    def __init__(self, model: nn.Module, device: torch.device, max_num_seqs: int,
                 max_model_len: int, block_size: int,
                 max_num_batched_tokens: int | None = None) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.sizes = capture_sizes(max_num_seqs)
        self.mixed_sizes = (mixed_capture_sizes(max_num_batched_tokens)
                            if max_num_batched_tokens else [])
        self.max_model_len = max_model_len
        self.block_size = block_size
        tokens = max([self.sizes[-1], *self.mixed_sizes])
        seqs = max_num_seqs
        width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.arange = torch.arange(seqs + 1, dtype=torch.int32, device=device)
        self.query_start_loc = self.arange.clone()
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((seqs, width), dtype=torch.int32, device=device)
        self._qsl_is_arange = True
        from vllmpy.ops import step_inputs  # Triton, imported only where graphs are built

        # decode graphs: the packed per-request inputs (vllmpy.ops.step_inputs), their
        # pinned host side, the token ids unpacked from them, and the last sampled ids
        self.decode_inputs = torch.zeros((step_inputs.NUM_ROWS, seqs), dtype=torch.int64,
                                         device=device)
        self.decode_inputs[step_inputs.SLOTS] = -1
        self.decode_inputs[step_inputs.FILL] = -1
        self._decode_host = torch.zeros((step_inputs.NUM_ROWS, seqs), dtype=torch.int64,
                                        pin_memory=device.type == "cuda")
        self.decode_positions = self.decode_inputs[step_inputs.POSITIONS]
        self.decode_slots = self.decode_inputs[step_inputs.SLOTS]
        self.decode_ids = torch.zeros(seqs, dtype=torch.int64, device=device)
        # the block tables [n, width] a decode step last copied to ``block_tables``, while
        # nothing has overwritten them since (None: unknown); a decode step whose tables
        # equal them (a request gets a new block every block_size tokens) copies nothing.
        # Their pinned host side, flat: a step's [n, width] is its first n * width entries.
        self._tables: np.ndarray | None = None
        self._tables_host = torch.zeros(seqs * width, dtype=torch.int32,
                                        pin_memory=device.type == "cuda")
        self.sampled = torch.zeros(seqs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode graphs by batch size
        # size -> (hidden states [size, hidden], logits [size, vocab])
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.logits: torch.Tensor | None = None  # [max size, vocab], shared by every size
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by token count
        self.mixed_outputs: dict[int, torch.Tensor] = {}  # token count -> hidden states

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def max_mixed_tokens(self) -> int:
        return self.mixed_sizes[-1] if self.mixed_sizes else 0

    def _mixed_seqs(self, tokens: int) -> int:
        """Request slots of the mixed graph for ``tokens``: no step has more requests
        than tokens."""
        return min(tokens, self.max_num_seqs)

    def _meta(self, size: int) -> AttentionMetadata:
        # max_seq_len = max_model_len fixes the kernels' split-KV choice for every replay
        return AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[:size + 1],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens=self.seq_lens[:size],
            seq_lens_cpu=[self.max_model_len] * size,
            slot_mapping=self.decode_slots[:size],
            block_tables=self.block_tables[:size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _mixed_meta(self, tokens: int) -> AttentionMetadata:
        # max_query_len = tokens picks the prefill kernel variant, max_seq_len the split count
        seqs = self._mixed_seqs(tokens)
        return AttentionMetadata(
            num_actual_tokens=tokens,
            query_start_loc=self.query_start_loc[:seqs + 1],
            query_start_loc_cpu=[0] * (seqs + 1),
            seq_lens=self.seq_lens[:seqs],
            seq_lens_cpu=[self.max_model_len] * seqs,
            slot_mapping=self.slot_mapping[:tokens],
            block_tables=self.block_tables[:seqs],
            block_size=self.block_size,
            max_query_len=tokens,
            max_seq_len=self.max_model_len,
        )

    def _mixed_forward(self, tokens: int) -> torch.Tensor:
        """The mixed step of ``tokens`` padding tokens (its request slots set empty
        beforehand, outside any capture)."""
        return self.model(self.input_ids[:tokens], self.positions[:tokens],
                          self._mixed_meta(tokens))

    def _decode_forward(self, size: int) -> torch.Tensor:
        """The decode step of ``size`` requests from the packed inputs (padding while
        warming up and capturing); returns the hidden states."""
        from vllmpy.ops.step_inputs import unpack_decode_inputs

        unpack_decode_inputs(self.decode_inputs, self.sampled, self.decode_ids, self.seq_lens,
                             size)
        return self.model(self.decode_ids[:size], self.decode_positions[:size],
                          self._meta(size))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every graph's forward (and the decode graphs' logits) once, eagerly, without
        capturing: what ``capture`` launches, for recording the kernels it needs."""
        for tokens in reversed(self.mixed_sizes):
            self.query_start_loc[:self._mixed_seqs(tokens) + 1].zero_()
            self._mixed_forward(tokens)
        self.query_start_loc.copy_(self.arange)
        self._qsl_is_arange = True
        for size in reversed(self.sizes):
            hidden = self._decode_forward(size)
            logits = self.model.compute_logits(hidden)  # type: ignore[operator]
            greedy_ids(logits, out=self.sampled[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph, largest first, into one pool. The static buffers hold only
        padding while capturing, so nothing is written to the KV cache."""
        pool = None
        for tokens in reversed(self.mixed_sizes):
            self.query_start_loc[:self._mixed_seqs(tokens) + 1].zero_()  # every slot empty
            self._mixed_forward(tokens)  # warm-up: compiles kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._mixed_forward(tokens)
            if pool is None:
                pool = graph.pool()
            self.mixed_graphs[tokens] = graph
            self.mixed_outputs[tokens] = hidden
        self.query_start_loc.copy_(self.arange)
        self._qsl_is_arange = True
        for size in reversed(self.sizes):
            # warm-up: compiles kernels, builds rotary tables
            logits = self.model.compute_logits(self._decode_forward(size))  # type: ignore[operator]
            if self.logits is None:  # one logits buffer that every size writes into
                self.logits = torch.empty((self.sizes[-1], logits.shape[1]), dtype=logits.dtype,
                                          device=logits.device)
            del logits
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._decode_forward(size)
                self.model.compute_logits(hidden, out=self.logits[:size])  # type: ignore[operator]
                # every row's argmax, where the sampler puts its ids: a step whose requests
                # all sample greedily, with nothing that changes their logits, takes these
                # and skips the sampler's launches on the host
                greedy_ids(self.logits[:size], out=self.sampled[:size])
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
            self.outputs[size] = (hidden, self.logits[:size])
        torch.cuda.synchronize()

    def run(self, n: int, input_ids: np.ndarray, positions: np.ndarray,
            slot_mapping: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
            fill_rows: np.ndarray | None = None,
            copied: torch.cuda.Event | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for a decode step of ``n`` requests; returns (hidden states [n, hidden],
        logits [n, vocab]), views of the graph's outputs that the next replay overwrites;
        ``sampled[:n]`` then holds each row's argmax (greedy's ids, before any sampler).
        The per-request inputs are host arrays (``n`` entries each), ``block_tables`` an
        int32 [n, width] (copied only when it differs from the last decode step's).
        ``fill_rows[i]`` >= 0 takes request i's token from that row of ``sampled`` (the
        previous step's ids, still on the device) instead of ``input_ids[i]``. The caller
        must not rewrite the pinned inputs before ``copied``, recorded once they are copied
        (before the replay), has passed."""
        size = next(s for s in self.sizes if s >= n)
        from vllmpy.ops import step_inputs

        host = self._decode_host.numpy()
        host[step_inputs.IDS, :n] = input_ids
        host[step_inputs.POSITIONS, :n] = positions
        host[step_inputs.SLOTS, :n] = slot_mapping
        host[step_inputs.FILL, :n] = -1 if fill_rows is None else fill_rows
        host[step_inputs.SEQ_LENS, :n] = seq_lens
        if size > n:  # padding requests: nothing stored, nothing attended
            host[:, n:size] = 0
            host[step_inputs.SLOTS, n:size] = -1
            host[step_inputs.FILL, n:size] = -1
        # one copy for all rows; the graph reads only its first `size` columns of each
        self.decode_inputs.copy_(self._decode_host, non_blocking=True)
        if self._tables is None or not np.array_equal(self._tables, block_tables):
            width = block_tables.shape[1]
            staged = self._tables_host[:n * width].view(n, width)
            staged.numpy()[:] = block_tables
            self.block_tables[:n, :width].copy_(staged, non_blocking=True)
            self._tables = np.array(block_tables, dtype=np.int32, copy=True)
        if not self._qsl_is_arange:  # a mixed step rewrote it
            self.query_start_loc.copy_(self.arange)
            self._qsl_is_arange = True
        if copied is not None:
            copied.record()
        self.graphs[size].replay()
        hidden, logits = self.outputs[size]
        return hidden[:n], logits[:n]

    def run_mixed(self, num_tokens: int, input_ids: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  fill: tuple[torch.Tensor, torch.Tensor] | None = None,
                  copied: torch.cuda.Event | None = None) -> torch.Tensor:
        """Replay for a step of ``num_tokens`` tokens (at most ``max_mixed_tokens``) over
        ``len(seq_lens)`` requests; returns the hidden states [num_tokens, hidden], a view
        that the next replay overwrites. Arguments as for ``run``, plus the step's
        ``query_start_loc`` [num_requests + 1]."""
        size = next(s for s in self.mixed_sizes if s >= num_tokens)
        n, seqs = seq_lens.shape[0], self._mixed_seqs(size)
        self._qsl_is_arange = False
        self._copy_tokens(num_tokens, size, input_ids, positions, slot_mapping, fill)
        self.query_start_loc[:n + 1].copy_(query_start_loc, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        if seqs > n:  # empty request slots, all starting at the step's end
            self.query_start_loc[n + 1:seqs + 1].fill_(num_tokens)
            self.seq_lens[n:seqs].zero_()
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self._tables = None  # the decode step after this copies its tables again
        if copied is not None:
            copied.record()
        self.mixed_graphs[size].replay()
        return self.mixed_outputs[size][:num_tokens]

    def _copy_tokens(self, n: int, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
                     slot_mapping: torch.Tensor,
                     fill: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The step's ``n`` token rows into the static buffers; rows ``n:size`` become
        padding (their keys and values are not stored)."""
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if fill is not None:  # (rows, ids): tokens that only the device holds yet
            self.input_ids.index_copy_(0, fill[0], fill[1])
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
