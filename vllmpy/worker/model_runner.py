"""The device side of one step: scheduler output -> input tensors -> forward -> sampled ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
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
from vllmpy.worker.input_batch import InputBatch, StepInputs

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
        self.input_batch = InputBatch(config.scheduler.max_num_seqs,
                                      config.model.max_model_len, self.block_size)
        self._pinned: dict[str, torch.Tensor] = {}  # staging buffers for host -> device
        self._staged: torch.cuda.Event | None = None  # when the last copies were queued
        # (sampled request ids, metadata) of the last step, while reusable
        self._md_cache: tuple[tuple[str, ...], SamplingMetadata] | None = None

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
        from vllmpy.layers.attention import report_kv_scales

        report_kv_scales(layers, cache.kv_cache_dtype)  # fp8 without checkpoint scales
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
        batch = self.input_batch
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove(req_id)
        for new in out.scheduled_new_reqs:
            state = self._new_state(new)
            self.requests[new.req_id] = state
            batch.remove(new.req_id)  # a preempted request may come back before it left
            batch.add(new.req_id, state.prompt_token_ids + state.output_token_ids,
                      state.block_ids, new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        appended = cached.new_token_ids or [[]] * len(cached.req_ids)
        for req_id, new_blocks, computed, tokens in zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, appended):
            state = self.requests[req_id]
            row = batch.index[req_id]
            if new_blocks:
                state.block_ids.extend(new_blocks)
                batch.append_blocks(row, new_blocks)
            if tokens:  # appended by the scheduler (jump-forward), not sampled here
                state.output_token_ids.extend(tokens)
                batch.append_tokens(row, tokens)
            state.num_computed_tokens = computed
            batch.num_computed[row] = computed

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

    def _stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """``array`` as a host tensor the device can copy from without blocking: a view of
        a pinned buffer on CUDA, the array itself on the CPU."""
        if self.device.type != "cuda":
            return torch.from_numpy(np.ascontiguousarray(array))
        flat = array.reshape(-1)
        buf = self._pinned.get(name)
        if buf is None or buf.numel() < flat.size:
            buf = torch.empty(max(flat.size, 1024), dtype=_TORCH_DTYPES[array.dtype.type],
                              pin_memory=True)
            self._pinned[name] = buf
        view = buf[:flat.size]
        view.numpy()[:] = flat
        return view.view(array.shape)

    def _prepare_inputs(self, req_ids: list[str], out: SchedulerOutput):
        step = self.input_batch.prepare(req_ids,
                                        [out.num_scheduled_tokens[r] for r in req_ids])
        if self._staged is not None:
            # The pinned buffers are about to be rewritten: the previous step's copies
            # out of them must have run.
            self._staged.synchronize()
        host = {name: self._stage(name, getattr(step, name))
                for name in ("input_ids", "positions", "slot_mapping", "query_start_loc",
                             "seq_lens", "block_tables", "logits_indices")}
        return step, host

    def _device_inputs(self, step: StepInputs, host: dict[str, torch.Tensor]):
        dev = self.device
        d = {name: t.to(dev, non_blocking=True) for name, t in host.items()}
        meta = AttentionMetadata(
            num_actual_tokens=step.num_tokens,
            query_start_loc=d["query_start_loc"],
            query_start_loc_cpu=step.query_start_loc.tolist(),
            seq_lens=d["seq_lens"],
            seq_lens_cpu=step.seq_lens.tolist(),
            slot_mapping=d["slot_mapping"],
            block_tables=d["block_tables"],
            block_size=self.block_size,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
        )
        return d["input_ids"], d["positions"], meta, d["logits_indices"]

    def _generator(self, state: CachedRequestState) -> torch.Generator | None:
        """A seeded request draws from a generator keyed on (seed, output position), so its
        tokens depend on neither the batch it shares nor a preemption in between."""
        seed = state.sampling_params.seed
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed((seed * 1_000_003 + len(state.output_token_ids)) % (2**63))
        return gen

    def _sampling_metadata(self, sampled_ids: tuple[str, ...],
                           states: list[CachedRequestState]) -> SamplingMetadata:
        """Build the step's sampling metadata, or reuse the last step's when the same
        requests sample and nothing in it depends on the tokens generated so far."""
        cached = self._md_cache
        if cached is not None and cached[0] == sampled_ids:
            return cached[1]
        md = SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            generators=[self._generator(s) for s in states],
            eos_token_ids=[s.eos_token_ids for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
        )
        # Penalties read the outputs, seeded rows a per-position generator, min_tokens
        # the output count (once no row is under it, none ever is again).
        reusable = md.no_penalties and not md.generators and md.no_min_tokens
        self._md_cache = (sampled_ids, md) if reusable else None
        return md

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.model is not None
        self._update_states(out)
        req_ids = list(out.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [])
        step, host = self._prepare_inputs(req_ids, out)
        graphs = self.decode_graphs
        n = len(req_ids)
        if graphs is not None and step.max_query_len == 1 and n <= graphs.max_size:
            # A pure decode step: the graph reads its inputs straight from the host.
            hidden = graphs.run(n, host["input_ids"], host["positions"],
                                host["slot_mapping"], host["seq_lens"], host["block_tables"])
            logits_idx = None  # every request samples
        else:
            ids, pos, meta, logits_idx = self._device_inputs(step, host)
            hidden = self.model(ids, pos, meta)  # [num_tokens, hidden_size]
            if len(step.sample_rows) == step.num_tokens:
                logits_idx = None
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        sampled: list[list[int]] = [[] for _ in req_ids]
        if step.sample_rows:
            if logits_idx is not None:
                hidden = hidden[logits_idx]
            logits = self.model.compute_logits(hidden)  # [num_sampled, vocab]
            states = [self.requests[req_ids[i]] for i in step.sample_rows]
            metadata = self._sampling_metadata(
                tuple(req_ids[i] for i in step.sample_rows), states)
            token_ids = self.sampler(logits, metadata).tolist()  # the step's one sync
            batch = self.input_batch
            for row, state, tok in zip(step.sample_rows, states, token_ids):
                state.output_token_ids.append(tok)
                batch.append_tokens(batch.index[state.req_id], [tok])
                sampled[row] = [tok]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}
