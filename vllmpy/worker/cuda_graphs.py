"""CUDA graphs of the model's forward, sharing one memory pool: decode graphs (the forward,
its logits and each row's argmax) for a list of batch sizes, and mixed graphs (the forward
alone) for small steps that carry prefill tokens.

A decode step (every request computes one token) replays the decode graph of the smallest
captured size that holds it. A step of at most ``max_mixed_tokens`` tokens that is not a
pure decode (a short prefill chunk, say the few new tokens after a cached prefix, with or
without decodes beside it) replays the mixed graph of the smallest token count that holds
it; its logits are computed after the replay, for the rows that sample. Longer steps run
eagerly: their GPU time dwarfs the launch cost a graph saves.

Every graph reads the runner's persistent input buffers (``vllmpy.worker.step_buffers``):
its first kernel unpacks the step the runner staged, padded to the graph's shape, so eager
steps and both kinds of graph take their inputs the same way. Rows past the real batch are
padding: their KV slot is -1 (not stored), their sequence length 0 and their query range
empty, so attention skips them and their hidden states are discarded. A decode graph ends
by writing each row's argmax into the buffers' ``sampled``, so that a step of greedy
requests needs no sampler launch after the replay.
"""

from __future__ import annotations

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.sample.sampler import greedy_ids
from vllmpy.worker.step_buffers import StepBuffers

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
    def __init__(self, model: nn.Module, buffers: StepBuffers, max_num_seqs: int,
                 max_model_len: int, max_num_batched_tokens: int | None = None) -> None:
        self.model = model
        self.buffers = buffers
        self.max_num_seqs = max_num_seqs
        self.sizes = capture_sizes(max_num_seqs)
        self.mixed_sizes = (mixed_capture_sizes(max_num_batched_tokens)
                            if max_num_batched_tokens else [])
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode graphs by batch size
        # size -> (hidden states [size, hidden], logits [size, vocab])
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.logits: torch.Tensor | None = None  # [max size, vocab], shared by every size
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by token count
        self.mixed_outputs: dict[int, torch.Tensor] = {}  # token count -> hidden states

    @property
    def sampled(self) -> torch.Tensor:
        return self.buffers.sampled

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def max_mixed_tokens(self) -> int:
        return self.mixed_sizes[-1] if self.mixed_sizes else 0

    def decode_size(self, n: int) -> int:
        """The decode graph that runs a decode step of ``n`` requests."""
        return next(s for s in self.sizes if s >= n)

    def mixed_size(self, num_tokens: int) -> int:
        """The mixed graph that runs a step of ``num_tokens`` tokens."""
        return next(s for s in self.mixed_sizes if s >= num_tokens)

    def mixed_seqs(self, tokens: int) -> int:
        """Request slots of the mixed graph for ``tokens``: no step has more requests
        than tokens."""
        return min(tokens, self.max_num_seqs)

    def _meta(self, size: int) -> AttentionMetadata:
        # max_seq_len = max_model_len fixes the kernels' split-KV choice for every replay
        return self.buffers.metadata(size, size, list(range(size + 1)),
                                     [self.max_model_len] * size, 1, self.max_model_len)

    def _mixed_meta(self, tokens: int) -> AttentionMetadata:
        # max_query_len = tokens picks the prefill kernel variant, max_seq_len the split count
        seqs = self.mixed_seqs(tokens)
        return self.buffers.metadata(tokens, seqs, [0] * (seqs + 1),
                                     [self.max_model_len] * seqs, tokens, self.max_model_len)

    def _forward(self, tokens: int, seqs: int, meta: AttentionMetadata) -> torch.Tensor:
        """Unpack the staged step of this shape and run the model over it."""
        self.buffers.unpack(tokens, seqs)
        t = self.buffers.tensors
        return self.model(t.input_ids[:tokens], t.positions[:tokens], meta)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every graph's forward (and the decode graphs' logits) once, eagerly, without
        capturing: what ``capture`` launches, for recording the kernels it needs."""
        for tokens in reversed(self.mixed_sizes):
            self.buffers.stage_padding(tokens, self.mixed_seqs(tokens))
            self._forward(tokens, self.mixed_seqs(tokens), self._mixed_meta(tokens))
        for size in reversed(self.sizes):
            self.buffers.stage_padding(size, size, decode=True)
            hidden = self._forward(size, size, self._meta(size))
            logits = self.model.compute_logits(hidden)  # type: ignore[operator]
            greedy_ids(logits, out=self.sampled[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph, largest first, into one pool. The buffers hold only
        padding while capturing, so nothing is written to the KV cache."""
        pool = None
        for tokens in reversed(self.mixed_sizes):
            seqs = self.mixed_seqs(tokens)
            self.buffers.stage_padding(tokens, seqs)  # every request slot empty
            meta = self._mixed_meta(tokens)
            self._forward(tokens, seqs, meta)  # warm-up: compiles kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(tokens, seqs, meta)
            if pool is None:
                pool = graph.pool()
            self.mixed_graphs[tokens] = graph
            self.mixed_outputs[tokens] = hidden
        for size in reversed(self.sizes):
            self.buffers.stage_padding(size, size, decode=True)
            meta = self._meta(size)
            # warm-up: compiles kernels, builds rotary tables
            logits = self.model.compute_logits(  # type: ignore[operator]
                self._forward(size, size, meta))
            if self.logits is None:  # one logits buffer that every size writes into
                self.logits = torch.empty((self.sizes[-1], logits.shape[1]), dtype=logits.dtype,
                                          device=logits.device)
            del logits
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size, size, meta)
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

    def run(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for a decode step of ``n`` requests, staged in the buffers padded to
        ``decode_size(n)``; returns (hidden states [n, hidden], logits [n, vocab]), views
        of the graph's outputs that the next replay overwrites; ``sampled[:n]`` then holds
        each row's argmax (greedy's ids, before any sampler)."""
        size = self.decode_size(n)
        self.graphs[size].replay()
        hidden, logits = self.outputs[size]
        return hidden[:n], logits[:n]

    def run_mixed(self, num_tokens: int) -> torch.Tensor:
        """Replay for a step of ``num_tokens`` tokens (at most ``max_mixed_tokens``),
        staged padded to ``mixed_size(num_tokens)`` x its ``mixed_seqs``; returns the
        hidden states [num_tokens, hidden], a view the next replay overwrites."""
        size = self.mixed_size(num_tokens)
        self.mixed_graphs[size].replay()
        return self.mixed_outputs[size][:num_tokens]
