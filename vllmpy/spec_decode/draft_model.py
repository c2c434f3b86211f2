"""``draft_model``: a second, smaller checkpoint with the target's vocabulary proposes the
drafts, greedily, one forward per draft token.

The draft has its own paged KV (one cache per draft attention layer) laid out on the
target's block table: token ``i`` of a request lives in the same block and slot in both
pools, so the scheduler's allocation serves both, and ``num_lookahead_tokens`` slots past
each step hold the KV of the draft's own drafts. Per request the proposer remembers how
many tokens its KV holds; after a step it first computes the tokens it has not seen (the
whole prompt the first time, then the tokens the step emitted, less the drafts it fed
itself that the target accepted), chunked to the step's token budget, then runs k - 1
one-token steps for the rest of the drafts (on CUDA through decode graphs of the draft,
one per batch size the target captures, and a catch-up of few tokens through the draft's
mixed graphs). A request it meets again after a preemption, or one served from the
target's prefix cache, starts from its first token: the draft's KV of shared blocks is
rewritten with the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllmpy.config import ConfigError, log
from vllmpy.layers.attention import Attention
from vllmpy.loader.load_stats import LoadStats
from vllmpy.loader.source import ModelSource, resolve_model_source
from vllmpy.sample.sampler import greedy_ids
from vllmpy.spec_decode import Proposer
from vllmpy.spec_decode.config import FLAG, SpeculativeConfig
from vllmpy.worker.cuda_graphs import StepGraphs
from vllmpy.worker.input_batch import StepInputs
from vllmpy.worker.step_buffers import StepBuffers


def draft_source(config: SpeculativeConfig, target_kind: str) -> ModelSource:
    """Where the draft's weights come from (random ones when the target's are)."""
    assert config.model is not None
    try:
        return resolve_model_source(config.model,
                                    load_format="dummy" if target_kind == "dummy" else "auto",
                                    revision=config.revision)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{FLAG}: draft model {config.model!r}: {e}") from None


def draft_text_config(source: ModelSource, target_vocab_size: int) -> Any:
    """The draft's TextModelConfig; its vocabulary must be the target's."""
    from vllmpy.models.registry import text_config

    text = text_config(source.hf_config)
    if text.vocab_size != target_vocab_size:
        raise ConfigError(f"{FLAG}: the draft model {source.model!r} has a vocabulary of "
                          f"{text.vocab_size} tokens, the target {target_vocab_size}: a "
                          f"draft must share the target's tokenizer and vocabulary")
    return text


def kv_config(config: SpeculativeConfig, target_source_kind: str, target_text: Any) -> Any:
    return draft_text_config(draft_source(config, target_source_kind), target_text.vocab_size)


class ModelProposer(Proposer):
    """A proposer that runs a model of its own (a draft model, an EAGLE head) with paged
    KV on the target's block table, through step buffers of its own."""

    def _load(self, config: SpeculativeConfig, runner: Any, source: ModelSource, text: Any,
              what: str, model_cls: Any = None) -> float:
        """Build and load the proposer's model; returns the seconds it took."""
        from vllmpy.layers.quantization import QuantizationError, quantization_config

        self.k = config.num_speculative_tokens
        self.num_lookahead_tokens = self.k
        self.runner = runner
        self.text = text
        model_dir = source.path if source.kind in ("hf_dir", "dummy") else None
        try:
            quant = quantization_config(source.kind, source.hf_config, model_dir,
                                        config.quantization)
            if quant is not None:
                quant.bind_target(runner.device, runner.config.model.dtype)
        except QuantizationError as e:
            raise ConfigError(f"{FLAG}: {what}: {e}") from None
        stats = LoadStats()
        self.model = self._build(source, text, quant, stats, model_cls)
        sched = runner.config.scheduler
        self.budget = sched.max_num_batched_tokens
        self.buffers = StepBuffers(runner.device,
                                   max(sched.max_num_batched_tokens, sched.max_num_seqs),
                                   sched.max_num_seqs, runner.input_batch.max_blocks,
                                   runner.block_size)
        self.kv_caches: list[torch.Tensor] = []
        return sum(stats.seconds.values())

    def _build(self, source: ModelSource, text: Any, quant: Any, stats: LoadStats,
               model_cls: Any) -> Any:
        """The proposer's model, built and loaded (the runner's way by default)."""
        return self.runner.build_model(source, text, quant, stats, model_cls=model_cls)

    def _inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``step`` staged in the proposer's buffers: (ids, positions, attention
        metadata) for one eager forward."""
        bufs = self.buffers
        n, r = step.num_tokens, len(step.seq_lens)
        bufs.stage(step, n, r)
        bufs.unpack(n, r)
        meta = bufs.metadata(n, r, step.query_start_loc.tolist(), step.seq_lens.tolist(),
                             step.max_query_len, step.max_seq_len)
        return bufs.tensors.input_ids[:n], bufs.tensors.positions[:n], meta

    def initialize_kv_cache(self) -> None:
        cache = self.runner.config.cache
        shape = (2, cache.num_blocks, cache.block_size, self.text.num_key_value_heads,
                 self.text.head_dim)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_caches = [torch.zeros(shape, dtype=cache.kv_cache_dtype,
                                      device=self.runner.device) for _ in layers]
        for layer, kv in zip(layers, self.kv_caches):
            layer.bind(kv)


class DraftModelProposer(ModelProposer):
    def __init__(self, config: SpeculativeConfig, runner: Any) -> None:
        source = draft_source(config, runner.config.model.source_kind)
        seconds = self._load(config, runner, source,
                             draft_text_config(source, runner.vocab_size), "draft model")
        log(f"speculative decoding: draft model {source.model} loaded "
            f"({self.text.architectures[0]}, {self.text.num_hidden_layers} layers) in "
            f"{seconds:.2f} s")
        # req_id -> how many of its first tokens the draft's KV holds
        self.computed: dict[str, int] = {}
        # req_id -> the drafts its last proposal fed the draft after those tokens (their KV
        # stands wherever the target went on to accept them)
        self.fed: dict[str, list[int]] = {}
        self.graphs: StepGraphs | None = None  # the draft's decode graphs (CUDA)

    def capture_graphs(self) -> str:
        runner = self.runner
        self.graphs = StepGraphs(self.model, self.buffers, runner.config.scheduler.max_num_seqs,
                                 runner.config.model.max_model_len, self.budget)
        self.graphs.capture()
        sizes, mixed = self.graphs.sizes, self.graphs.mixed_sizes
        return (f"the draft's one-token steps ({len(sizes)} batch sizes, {sizes[0]}..{sizes[-1]})"
                f" and catch-up steps ({len(mixed)} token counts, up to {mixed[-1]})"
                if mixed else
                f"the draft's one-token steps ({len(sizes)} batch sizes, {sizes[0]}..{sizes[-1]})")

    def forget(self, req_id: str) -> None:
        self.computed.pop(req_id, None)
        self.fed.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: Sequence[int],
                max_drafts: Sequence[int]) -> list[list[int]]:
        batch = self.runner.input_batch
        req_ids = [batch.req_ids[r] for r in rows]
        ends = num_tokens[list(rows)].astype(np.int64)
        drafts: list[list[int]] = [[] for _ in rows]
        self._keep_accepted(req_ids, token_ids, rows, ends)
        self._catch_up(req_ids, ends, drafts)
        for j in range(1, max(max_drafts, default=0)):
            active = [i for i, m in enumerate(max_drafts) if m > j]
            for i in active:
                batch.set_drafts(rows[i], drafts[i])
            step = batch.prepare([req_ids[i] for i in active], [1] * len(active),
                                 [j] * len(active), ends[active] + j - 1)
            for i, tok in zip(active, self._forward(step)):
                drafts[i].append(tok)
        for r, d, m in zip(req_ids, drafts, max_drafts):
            self.fed[r] = d[:max(m - 1, 0)]  # d[j - 1] went in at step j above
        return [d[:m] for d, m in zip(drafts, max_drafts)]

    def _keep_accepted(self, req_ids: list[str], token_ids: np.ndarray, rows: Sequence[int],
                       ends: np.ndarray) -> None:
        """Count as computed the fed drafts the target accepted: the draft's KV at a
        position stands when the tokens up to it are the ones it was computed from. The
        last token is always left to compute (its logits give the first draft)."""
        for r, row, end in zip(req_ids, rows, ends):
            fed, start = self.fed.pop(r, None), self.computed.get(r)
            if not fed or start is None:
                continue
            kept = 0
            for tok in fed:
                if start + kept >= end - 1 or int(token_ids[row, start + kept]) != tok:
                    break
                kept += 1
            self.computed[r] = start + kept

    def _catch_up(self, req_ids: list[str], ends: np.ndarray,
                  drafts: list[list[int]]) -> None:
        """Compute every token the draft has not seen, in forwards of at most the step's
        budget; each request's first draft is the argmax after its last token."""
        starts = np.array([self.computed.get(r, 0) for r in req_ids], dtype=np.int64)
        for r, end in zip(req_ids, ends):
            self.computed[r] = int(end)
        while True:
            todo = np.nonzero(starts < ends)[0]
            if not len(todo):
                return
            take = np.minimum(ends[todo] - starts[todo],
                              max(1, self.budget // len(todo)))
            step = self.runner.input_batch.prepare([req_ids[i] for i in todo],
                                                   take.tolist(), None, starts[todo])
            tokens = self._forward(step)
            for i, tok in zip(todo[step.sample_rows], tokens):
                drafts[i].append(tok)
            starts[todo] += take

    def _forward(self, step: StepInputs) -> list[int]:
        """One forward of the draft; the argmax at each sampling request's last token. A
        one-token step replays the decode graph of its size, a small catch-up (the tokens
        a verify emitted) the mixed graph of its token count; larger ones run eagerly."""
        graphs, n = self.graphs, len(step.seq_lens)
        if (graphs is not None and step.max_query_len == 1 and len(step.sample_rows) == n
                and n <= graphs.max_size):
            size = graphs.decode_size(n)
            self.buffers.stage(step, size, size, decode=True)
            graphs.run(n)
            return graphs.sampled[:n].tolist()
        if graphs is not None and step.num_tokens <= graphs.max_mixed_tokens:
            tokens = graphs.mixed_size(step.num_tokens)
            self.buffers.stage(step, tokens, graphs.mixed_seqs(tokens))
            hidden = graphs.run_mixed(step.num_tokens)
        else:
            hidden = self.model(*self._inputs(step))
        if not step.sample_rows:
            return []
        index = torch.as_tensor(step.logits_indices, device=hidden.device)
        logits = self.model.compute_logits(hidden[index])
        return greedy_ids(logits.float()).tolist()


def make(config: SpeculativeConfig, runner: Any) -> DraftModelProposer:
    return DraftModelProposer(config, runner)
