"""The device side of one step: scheduler output -> input tensors -> forward -> sampled ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import EngineConfig
from vllmpy.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from vllmpy.layers.attention import Attention
from vllmpy.loader.load_stats import LoadStats
from vllmpy.loader.source import ModelSource, iter_checkpoint_weights
from vllmpy.models.interface import CausalLM
from vllmpy.models.registry import resolve_model_class
from vllmpy.sample.metadata import SamplingMetadata
from vllmpy.sample.sampler import Sampler
from vllmpy.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllmpy.worker.cuda_graphs import DecodeGraphs


@dataclass
class CachedRequestState:
    """What the runner keeps about a request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: set[int] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


class ModelRunner:
    """Holds the model, the KV cache and the requests it is running.

    ``execute_model`` is called once per step with the scheduler's plain description of
    the step and returns one list of sampled ids per scheduled request.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.text_config.vocab_size
        self.eos_token_ids = set(config.model.eos_token_ids)
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.model: CausalLM | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._load_stats = LoadStats()
        # CUDA graphs of the decode forward, once captured (CUDA without enforce_eager)
        self.decode_graphs: DecodeGraphs | None = None

    # ---- start-up -------------------------------------------------------------------

    def load_model(self, source: ModelSource) -> None:
        stats = LoadStats()
        mc = self.config.model
        with stats.phase("build"):
            model_cls = resolve_model_class(mc.text_config.architectures)
            with torch.device("meta"):
                model = model_cls(mc.text_config)
            model = model.to_empty(device=self.device).to(mc.dtype)
        with stats.phase("weights"):
            if source.kind == "dummy":
                self._load_dummy(model)
            else:
                model.load_weights(  # type: ignore[operator]
                    iter_checkpoint_weights(source, mc.dtype))
        model.eval()
        self.model = model  # type: ignore[assignment]
        self._load_stats = stats

    def _load_dummy(self, model: nn.Module) -> None:
        from vllmpy.loader.dummy import dummy_weights

        params = dict(model.named_parameters())
        shapes = {name: (p.shape, p.dtype) for name, p in params.items()}
        with torch.no_grad():
            for name, tensor in dummy_weights(shapes, seed=self.config.model.seed,
                                              device=self.device):
                params[name].copy_(tensor)

    def initialize_kv_cache(self) -> None:
        """Allocate the paged pool and bind one cache tensor to every attention layer."""
        assert self.model is not None
        cache = self.config.cache
        text = self.config.model.text_config
        shape = (2, cache.num_blocks, cache.block_size, text.num_key_value_heads,
                 text.head_dim)
        assert isinstance(self.model, nn.Module)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        with self._load_stats.phase("kv_cache"):
            self.kv_caches = [torch.zeros(shape, dtype=cache.kv_cache_dtype, device=self.device)
                              for _ in layers]
        self._load_stats.report()
        for layer, kv in zip(layers, self.kv_caches):
            layer.kv_cache = kv
        if self.device.type == "cuda":
            from vllmpy.attention.triton_backend import TritonAttentionBackend

            for layer in layers:
                layer.backend = TritonAttentionBackend(
                    layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale)
            if not self.config.enforce_eager:
                self._capture_decode_graphs()

    def _capture_decode_graphs(self) -> None:
        from vllmpy.worker.cuda_graphs import DecodeGraphs

        with self._load_stats.phase("cuda_graphs"):
            graphs = DecodeGraphs(self.model, self.device,  # type: ignore[arg-type]
                                  self.config.scheduler.max_num_seqs,
                                  self.config.model.max_model_len, self.block_size)
            graphs.capture()
        self.decode_graphs = graphs

    # ---- one step -------------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = self._new_state(new)
        cached = out.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                                cached.num_computed_tokens):
            state = self.requests[req_id]
            state.block_ids.extend(new_blocks)
            state.num_computed_tokens = computed

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        return CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            eos_token_ids=self.eos_token_ids,
        )

    def _prepare_inputs(self, req_ids: list[str], out: SchedulerOutput):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []  # index into req_ids of requests that sample
        logits_indices: list[int] = []
        bs = self.block_size
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            n = out.num_scheduled_tokens[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            input_ids.extend(state.token_slice(start, end))
            positions.extend(range(start, end))
            blocks = state.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if end >= state.num_tokens:  # this chunk reaches the last known token
                sample_rows.append(i)
                logits_indices.append(query_start[-1] - 1)
        max_blocks = max(len(self.requests[r].block_ids) for r in req_ids)
        table = torch.zeros((len(req_ids), max_blocks), dtype=torch.int32)
        for i, req_id in enumerate(req_ids):
            blocks = self.requests[req_id].block_ids
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            query_start_loc_cpu=query_start,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            seq_lens_cpu=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=table.to(dev),
            block_size=bs,
            max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
            max_seq_len=max(seq_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        idx = torch.tensor(logits_indices, dtype=torch.int64, device=dev)
        return ids, pos, meta, sample_rows, idx

    def _generator(self, state: CachedRequestState) -> torch.Generator | None:
        """A seeded request draws from a generator keyed on (seed, output position), so its
        tokens depend on neither the batch it shares nor a preemption in between."""
        seed = state.sampling_params.seed
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed((seed * 1_000_003 + len(state.output_token_ids)) % (2**63))
        return gen

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model is not None
        self._update_states(out)
        req_ids = list(out.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [])
        ids, pos, meta, sample_rows, logits_idx = self._prepare_inputs(req_ids, out)
        graphs = self.decode_graphs
        if (graphs is not None and meta.max_query_len == 1
                and len(req_ids) <= graphs.max_size):
            hidden = graphs.run(ids, pos, meta)  # a pure decode step: replay
        else:
            hidden = self.model(ids, pos, meta)  # [num_tokens, hidden_size]
        sampled: list[list[int]] = [[] for _ in req_ids]
        if sample_rows:
            logits = self.model.compute_logits(hidden[logits_idx])  # [num_sampled, vocab]
            states = [self.requests[req_ids[i]] for i in sample_rows]
            metadata = SamplingMetadata.build(
                params=[s.sampling_params for s in states],
                prompt_token_ids=[s.prompt_token_ids for s in states],
                output_token_ids=[s.output_token_ids for s in states],
                generators=[self._generator(s) for s in states],
                eos_token_ids=[s.eos_token_ids for s in states],
                vocab_size=self.vocab_size,
                device=self.device,
            )
            token_ids = self.sampler(logits, metadata).tolist()
            for row, state, tok in zip(sample_rows, states, token_ids):
                state.output_token_ids.append(tok)
                sampled[row] = [tok]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


