"""The device side of one step: scheduler output -> input tensors -> forward -> sampled ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from vllmpy.config import EngineConfig, log
from vllmpy.core.cache_spec import CacheLayout, CacheSpec, RecurrentStateSpec
from vllmpy.core.sched_output import (
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from vllmpy.layers.attention import Attention
from vllmpy.layers.custom_op import bind_ops
from vllmpy.layers.linear import Linear, describe_quantized_layers
from vllmpy.layers.quantization import quantize_model
from vllmpy.layers.quantization.base import dtype_name
from vllmpy.layers.quantization.dense import cpu_bf16_rows, cpu_packs, cpu_packs_panels
from vllmpy.loader.load_stats import LoadStats
from vllmpy.loader.materialize import materialize
from vllmpy.loader.source import ModelSource, iter_checkpoint_weights
from vllmpy.models.interface import CausalLM
from vllmpy.models.registry import resolve_model_class
from vllmpy.ops import cpu_kernels
from vllmpy.ops.precompile import (
    KernelCompiler,
)
from vllmpy.sample.logprobs import (
    PromptChunk,
    PromptLogprobsPlan,
    SampledLogprobs,
    sampled_logprobs,
)
from vllmpy.sample.metadata import SamplingMetadata
from vllmpy.sample.sampler import Sampler, plain_argmax
from vllmpy.sampling_params import SamplingParams
from vllmpy.spec_decode import Proposer, make_proposer
from vllmpy.spec_decode.rejection_sampler import rejection_sample, to_device
from vllmpy.structured_output.bitmask import apply_step_grammar_bitmask
from vllmpy.worker.cuda_graphs import StepGraphs
from vllmpy.worker.input_batch import InputBatch, StepInputs
from vllmpy.worker.startup import StartupMixin
from vllmpy.worker.step_buffers import StepBuffers


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
    pooling_params: Any = None  # a pooling request's PoolingParams

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class ModelRunner(StartupMixin):
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
        # CUDA: worker processes compiling Triton kernels during the load (until compiled)
        self._compiler: KernelCompiler | None = None
        # CUDA graphs of decode steps and of small mixed steps, once captured (CUDA
        # without enforce_eager)
        self.graphs: StepGraphs | None = None
        sched = config.scheduler
        self.input_batch = InputBatch(sched.max_num_seqs, config.model.max_model_len,
                                      self.block_size)
        # every step's inputs go through these (one pinned copy per step)
        self.buffers = StepBuffers(self.device,
                                   max(sched.max_num_batched_tokens, sched.max_num_seqs),
                                   sched.max_num_seqs, self.input_batch.max_blocks,
                                   self.block_size)
        self._pinned: dict[str, torch.Tensor] = {}  # the sampled ids' host copies
        self._staged: torch.cuda.Event | None = None  # when the last copies were queued
        # The last launched step's sampled ids on the device, with each request's index
        # into them, until the host has read them; whether the next step may run ahead.
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._overlap_safe = False
        self._host_flip = 0
        # (sampled request ids, metadata) of the last step, while reusable
        self._md_cache: tuple[tuple[str, ...], SamplingMetadata] | None = None
        # Speculative decoding: the proposer of each step's drafts (set by load_model)
        self.proposer: Proposer | None = None
        self._told_no_drafts = False
        # A pooling runner: each step's requests are pooled, none samples (set by load_model)
        self.pooler: Any = None
        # Hybrid models: the free recurrent-state seats, each running request's seat and
        # the modules holding states (set by initialize_kv_cache)
        self._free_seats: list[int] = []
        self._seat_of: dict[str, int] = {}
        self._states: list[torch.Tensor] = []  # every recurrent layer's state tensors

    # ---- start-up -------------------------------------------------------------------

    def load_model(self, source: ModelSource) -> None:
        if self.device.type == "cuda":
            self._start_kernel_compiler()
        else:
            log(describe_cpu(self.config.model.dtype))
        stats = LoadStats()
        mc = self.config.model
        self.model = self.build_model(source, mc.text_config, mc.quantization, stats)
        self._load_stats = stats
        if mc.runner == "pooling":
            from vllmpy.pooling.pooler import Pooler

            self.pooler = Pooler(self.model, mc.pooling, self.device, mc.dtype,
                                 mc.text_config.hidden_size)
        if self.config.speculative is not None:
            self.proposer = make_proposer(self.config.speculative, self)
        if self._compiler is not None:
            self.compile_kernels()

    def build_model(self, source: ModelSource, text_config: Any, quantization: Any,
                    stats: LoadStats, model_cls: type[nn.Module] | None = None) -> CausalLM:
        """Build ``text_config``'s architecture (or ``model_cls``) on the runner's device
        and load its weights from ``source`` (random ones for a dummy source)."""
        dtype = self.config.model.dtype
        with stats.phase("build"):
            if model_cls is None:
                model_cls = resolve_model_class(text_config.architectures)
            with torch.device("meta"):
                model = model_cls(text_config)
                quantize_model(model, quantization)  # each linear layer's method
            materialize(model, self.device, dtype)
            bind_ops(model, self.device)  # native or device kernels, chosen once
        with stats.phase("weights"):
            if source.kind == "dummy":
                self._load_dummy(model)
            else:
                model.load_weights(  # type: ignore[operator]
                    iter_checkpoint_weights(source, dtype))
        model.eval()
        return model  # type: ignore[return-value]

    def _load_dummy(self, model: nn.Module) -> None:
        """Random weights: a linear layer's come dense and its quantization method
        quantizes them (so a quantized config runs its real kernels)."""
        from vllmpy.loader.dummy import dummy_weights

        seed = self.config.model.seed
        linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
        owned = {f"{n}.{p}" for n, m in linears.items() for p in m.method_params}
        # MoE layers with a quantization method take dense experts and quantize them
        experts = {name: m for name, m in model.named_modules()
                   if getattr(m, "method", None) is not None and hasattr(m, "load_dense")
                   and not isinstance(m, Linear)}
        owned |= {f"{n}.{p}" for n, m in experts.items() for p in m.method_params}
        params = {n: p for n, p in model.named_parameters() if n not in owned}
        shapes = {name: (p.shape, p.dtype) for name, p in params.items()}
        with torch.no_grad():
            for name, tensor in dummy_weights(shapes, seed=seed, device=self.device):
                params[name].copy_(tensor)
            for name, layer in linears.items():
                shape = {f"{name}.weight": ((layer.output_size, layer.input_size),
                                            self.config.model.dtype)}
                for _, weight in dummy_weights(shape, seed=seed, device=self.device):
                    layer.method.load_dense(layer, weight)
                layer.method.finish(layer)
            dtype = self.config.model.dtype
            for name, moe in experts.items():
                e, h, i = moe.num_experts, moe.hidden_size, moe.intermediate_size
                shapes = {f"{name}.w13": ((e, 2 * i, h), dtype), f"{name}.w2": ((e, h, i), dtype)}
                w13, w2 = (t for _, t in dummy_weights(shapes, seed=seed, device=self.device))
                moe.load_dense(w13, w2)
        if (line := describe_quantized_layers(model)) is not None:
            log(line)

    def initialize_kv_cache(self) -> None:
        """Allocate the pool as the model's cache layout says (``vllmpy.core.cache_spec``):
        one paged tensor per attention or MLA layer, bound to it, and on hybrid models one
        set of recurrent-state seats per recurrent layer."""
        assert self.model is not None
        cache = self.config.cache
        modules, specs = self._cache_modules()
        with self._load_stats.phase("kv_cache"):
            self.kv_caches = []
            for module, spec in zip(modules, specs):
                if isinstance(spec, RecurrentStateSpec):
                    states = spec.allocate(cache.num_seats, self.config.model.dtype,
                                           cache.ssm_cache_dtype, self.device)
                    self._states.extend(states.values())
                    module.bind_state(states)
                else:
                    kv = torch.zeros(spec.cache_shape(cache.num_blocks, cache.block_size),
                                     dtype=cache.kv_cache_dtype, device=self.device)
                    self.kv_caches.append(kv)
                    module.bind(kv)
        self._load_stats.report()
        if cache.num_seats:
            self._free_seats = list(range(cache.num_seats - 1, -1, -1))  # pop() gives 0 first
            self.buffers.enable_seats(cache.num_seats)
        layers = self._attention_layers()
        if self.proposer is not None:
            self.proposer.initialize_kv_cache()
        from vllmpy.layers.attention import report_kv_scales

        report_kv_scales(layers, cache.kv_cache_dtype)  # fp8 without checkpoint scales
        if (self.device.type == "cuda" and not self.config.enforce_eager
                and self.pooler is None):  # pooling steps are whole prompts: eager
            self._capture_graphs()
        from vllmpy.layers.moe import reset_moe_stats

        reset_moe_stats(self.model)  # VT_MOE_STATS counts from here: requests, no warm-up

    def _cache_modules(self) -> tuple[list[Any], list[CacheSpec]]:
        """The model's caching modules (those with ``cache_spec()``) in model order, and
        their specs; refused unless they are what the config declared (the pool was sized
        from the config's)."""
        assert isinstance(self.model, nn.Module)
        modules = [m for m in self.model.modules() if callable(getattr(m, "cache_spec", None))]
        specs = [m.cache_spec() for m in modules]
        declared = list(self.config.model.text_config.layer_cache_specs())
        if specs != declared:
            built = CacheLayout(tuple(specs)).describe()
            said = CacheLayout(tuple(declared)).describe()
            raise RuntimeError(f"{type(self.model).__name__}: its caching layers ({built}) are "
                               f"not the ones its config declares ({said}): {specs} != "
                               f"{declared}")
        return modules, specs

    def _attention_layers(self) -> list[Attention]:
        assert isinstance(self.model, nn.Module)
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def _bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """Give every paged layer its cache (and on CUDA the Triton backend), in model
        order."""
        modules, specs = self._cache_modules()
        paged = [m for m, spec in zip(modules, specs) if not isinstance(spec, RecurrentStateSpec)]
        for layer, kv in zip(paged, caches):
            layer.bind(kv)

    # ---- recurrent-state seats (hybrid models) ---------------------------------------

    def _take_seat(self, req_id: str) -> int:
        """A seat for a request entering the batch, its state zeroed (a request back from
        preemption recomputes its state from its first token)."""
        if not self._free_seats:
            raise RuntimeError(f"request {req_id!r}: every one of the "
                               f"{self.config.cache.num_seats} recurrent-state seats is taken "
                               f"(the scheduler admits at most max_num_seqs requests)")
        seat = self._free_seats.pop()
        self._seat_of[req_id] = seat
        for tensor in self._states:
            tensor[seat].zero_()
        return seat

    def _give_back_seat(self, req_id: str) -> None:
        seat = self._seat_of.pop(req_id, None)
        if seat is not None:
            self._free_seats.append(seat)

    def _capture_graphs(self) -> None:
        torch.cuda.empty_cache()  # as capture does: what grows after this is the graphs'
        before = torch.cuda.memory_reserved(self.device)
        sched = self.config.scheduler
        with self._load_stats.phase("cuda_graphs"):
            graphs = StepGraphs(self.model, self.buffers,  # type: ignore[arg-type]
                                sched.max_num_seqs, self.config.model.max_model_len,
                                sched.max_num_batched_tokens)
            graphs.capture()
        self.graphs = graphs
        grown = torch.cuda.memory_reserved(self.device) - before
        mixed = (f", {len(graphs.mixed_sizes)} mixed step sizes ({graphs.mixed_sizes[0]}.."
                 f"{graphs.mixed_sizes[-1]} tokens)" if graphs.mixed_sizes else "")
        log(f"CUDA graphs: {len(graphs.sizes)} decode batch sizes "
            f"({graphs.sizes[0]}..{graphs.sizes[-1]}){mixed} captured, "
            f"{grown / 2**30:.2f} GiB")
        if self.proposer is not None:
            before = torch.cuda.memory_reserved(self.device)
            with self._load_stats.phase("cuda_graphs"):
                what = self.proposer.capture_graphs()
            if what is not None:
                grown = torch.cuda.memory_reserved(self.device) - before
                log(f"speculative decoding: CUDA graphs of {what} captured, "
                    f"{grown / 2**30:.2f} GiB")

    # ---- one step -------------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in out.finished_req_ids:  # finished, aborted or preempted
            self.requests.pop(req_id, None)
            batch.remove(req_id)
            self._give_back_seat(req_id)
            if self.proposer is not None:
                self.proposer.forget(req_id)
        for new in out.scheduled_new_reqs:
            if self.proposer is not None:  # a preempted request starts over
                self.proposer.forget(new.req_id)
            state = self._new_state(new)
            self.requests[new.req_id] = state
            batch.remove(new.req_id)  # a preempted request may come back before it left
            seat = -1
            if self._states:
                self._give_back_seat(new.req_id)
                seat = self._take_seat(new.req_id)
            batch.add(new.req_id, state.prompt_token_ids + state.output_token_ids,
                      state.block_ids, new.num_computed_tokens, seat)
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
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            batch.set_drafts(batch.index[req_id], drafts)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        return CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            eos_token_ids=self.eos_token_ids,
            pooling_params=new.pooling_params,
        )

    def _generator(self, state: CachedRequestState, ahead: int = 0) -> torch.Generator | None:
        """A seeded request draws from a generator keyed on (seed, output position), so its
        tokens depend on neither the batch it shares nor a preemption in between.
        ``ahead``: the position that many tokens past its outputs (a verified draft's)."""
        seed = state.sampling_params.seed
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed((seed * 1_000_003 + len(state.output_token_ids) + ahead) % (2**63))
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

    def _prompt_logprobs(self, req_ids: list[str], out: SchedulerOutput, step: StepInputs,
                         hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of the prompt tokens this step's chunks score, for the requests that
        asked; ``hidden`` holds the states of every token of the step."""
        chunks = []
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            num_top = state.sampling_params.prompt_logprobs
            if num_top is not None:
                start = state.num_computed_tokens
                chunks.append(PromptChunk(req_id, state.prompt_token_ids, num_top, start,
                                          start + out.num_scheduled_tokens[req_id],
                                          int(step.query_start_loc[i])))
        plan = PromptLogprobsPlan.build(chunks) if chunks else None
        if plan is None:
            return {}
        assert self.model is not None
        return plan.run(hidden, self.model.compute_logits, self.vocab_size)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled ids."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> StepHandle:
        """Queue one step on the device and return at once; ``result()`` on the handle
        waits for its sampled ids. Positions whose token is still on the device (sampled
        by the previous launched step, not yet read back) take it from there."""
        assert self.model is not None
        self._update_states(out)
        req_ids = list(out.num_scheduled_tokens)
        if not req_ids:
            return StepHandle(self, [], [], [], None, None, {}, None)
        spec = out.scheduled_spec_decode_tokens
        step = self.input_batch.prepare(
            req_ids, [out.num_scheduled_tokens[r] for r in req_ids],
            [len(spec.get(r, ())) for r in req_ids] if spec else None)
        if self._staged is not None:
            # The pinned buffers are about to be rewritten: the previous step's copies
            # out of them must have run.
            self._staged.synchronize()
        graphs, bufs = self.graphs, self.buffers
        n, num_tokens = len(req_ids), step.num_tokens
        fill = self._fill_rows(req_ids, step)
        # Recorded once this step's copies out of the pinned buffers are queued: the next
        # step waits on it (not on this step's forward) before rewriting them.
        copied = torch.cuda.Event() if self.device.type == "cuda" else None
        graph_logits = None
        sampled_rows = len(step.sample_rows)
        if graphs is not None and step.max_query_len == 1 and n <= graphs.max_size:
            # a pure decode step: the decode graph of its size (token i is request i)
            size = graphs.decode_size(n)
            bufs.stage(step, size, size, fill, decode=True)
            if copied is not None:
                copied.record()
            hidden, graph_logits = graphs.run(n)
            if sampled_rows < n:  # a one-token prefill chunk samples nothing
                graph_logits = graph_logits[bufs.tensors.logits_indices[:sampled_rows]]
        elif graphs is not None and num_tokens <= graphs.max_mixed_tokens:
            # a small step with prefill tokens: the forward replays a mixed graph
            tokens = graphs.mixed_size(num_tokens)
            bufs.stage(step, tokens, graphs.mixed_seqs(tokens), fill)
            if copied is not None:
                copied.record()
            hidden = graphs.run_mixed(num_tokens)
        else:
            bufs.stage(step, num_tokens, n, fill)
            if copied is not None:
                copied.record()
            bufs.unpack(num_tokens, n)
            meta = bufs.metadata(num_tokens, n, step.query_start_loc.tolist(),
                                 step.seq_lens.tolist(), step.max_query_len,
                                 step.max_seq_len)
            t = bufs.tensors
            hidden = self.model(t.input_ids[:num_tokens], t.positions[:num_tokens], meta)
        logits_idx = (bufs.tensors.logits_indices[:sampled_rows]
                      if graph_logits is None and sampled_rows < num_tokens else None)
        self._staged = copied
        if self.pooler is not None:
            return self._pool(req_ids, step, hidden)
        if self.proposer is not None:
            self.proposer.observe(req_ids, step, hidden)
        prompt_logprobs = self._prompt_logprobs(req_ids, out, step, hidden)
        if step.spec_logits_indices is not None:
            return self._verify(out, req_ids, step, hidden, prompt_logprobs)
        if not step.sample_rows:
            self._last_sampled = None
            return StepHandle(self, req_ids, [], [], None, None, prompt_logprobs, None)
        if logits_idx is not None:
            hidden = hidden[logits_idx]
        logits = (graph_logits if graph_logits is not None
                  else self.model.compute_logits(hidden))  # [num_sampled, vocab]
        if out.grammar_bitmask is not None:  # structured output: forbidden -> -inf
            apply_step_grammar_bitmask(logits, out.grammar_bitmask,
                                       out.structured_output_request_ids,
                                       [req_ids[i] for i in step.sample_rows])
        states = [self.requests[req_ids[i]] for i in step.sample_rows]
        metadata = self._sampling_metadata(
            tuple(req_ids[i] for i in step.sample_rows), states)
        if (graph_logits is not None and sampled_rows == n and out.grammar_bitmask is None
                and plain_argmax(metadata)):
            # the decode graph's own argmax of these logits is the sampler's answer
            assert graphs is not None
            sampled_t, processed = graphs.sampled[:n], logits
        else:
            # the ids land in the buffers' ``sampled``, where the next step's unpack reads
            # the tokens it needs before the host has them
            sampled_t, processed = self.sampler.sample(logits, metadata,
                                                       out=bufs.sampled[:len(states)])
        lp = sampled_logprobs([s.sampling_params for s in states], logits, processed,
                              sampled_t)
        # The next step may read these ids before the host does (async scheduling).
        self._last_sampled = (sampled_t, {s.req_id: k for k, s in enumerate(states)})
        self._overlap_safe = (metadata.no_penalties and not metadata.generators
                              and metadata.no_min_tokens and out.grammar_bitmask is None)
        host_ids, ready = self._copy_to_host(sampled_t)
        return StepHandle(self, req_ids, step.sample_rows, states, host_ids, lp,
                          prompt_logprobs, ready)

    def _verify(self, out: SchedulerOutput, req_ids: list[str], step: StepInputs,
                hidden: torch.Tensor, prompt_logprobs: dict[str, LogprobsLists]
                ) -> StepHandle:
        """A step with drafts: score each sampling request's last drafts + 1 positions and
        let the rejection sampler choose its tokens (1 to drafts + 1 of them)."""
        assert self.model is not None and step.num_drafts is not None
        index = to_device(np.asarray(step.spec_logits_indices), self.device)
        logits = self.model.compute_logits(hidden[index])  # [sum(drafts + 1), vocab]
        states = [self.requests[req_ids[i]] for i in step.sample_rows]
        drafts = [out.scheduled_spec_decode_tokens.get(s.req_id, []) for s in states]
        row_states = [s for s, d in zip(states, drafts) for _ in range(len(d) + 1)]
        if out.grammar_bitmask is not None:  # (a grammar request carries no drafts)
            apply_step_grammar_bitmask(logits, out.grammar_bitmask,
                                       out.structured_output_request_ids,
                                       [s.req_id for s in row_states])
        # Row j of a request scores the position after its outputs and its first j drafts:
        # its metadata sees those drafts as outputs (penalties, min_tokens, the seed).
        outputs = [s.output_token_ids + d[:j] for s, d in zip(states, drafts)
                   for j in range(len(d) + 1)]
        generators = [self._generator(s, j) for s, d in zip(states, drafts)
                      for j in range(len(d) + 1)]
        params = [s.sampling_params for s in row_states]
        metadata = SamplingMetadata.build(
            params=params, prompt_token_ids=[s.prompt_token_ids for s in row_states],
            output_token_ids=outputs, generators=generators,
            eos_token_ids=[s.eos_token_ids for s in row_states],
            vocab_size=self.vocab_size, device=self.device)
        flat = to_device(np.fromiter((t for d in drafts for t in d), dtype=np.int64),
                         self.device)
        result = rejection_sample(logits, metadata, [len(d) for d in drafts], flat)
        lp = sampled_logprobs(params, logits, result.processed_logits, result.row_tokens)
        self._last_sampled = None  # (speculative steps are never launched ahead)
        self._overlap_safe = False
        self._md_cache = None
        packed = torch.cat([result.num_emitted.unsqueeze(1), result.token_ids], dim=1)
        host_ids, ready = self._copy_to_host(packed.flatten())
        return StepHandle(self, req_ids, step.sample_rows, states, host_ids, lp,
                          prompt_logprobs, ready, spec_width=packed.shape[1],
                          num_drafts=step.num_drafts)

    def _pool(self, req_ids: list[str], step: StepInputs, hidden: torch.Tensor
              ) -> StepHandle:
        """A pooling step: every request's whole prompt was computed; pool each one."""
        starts = step.query_start_loc[:-1].tolist()
        lengths = np.diff(step.query_start_loc).tolist()
        states = [self.requests[r] for r in req_ids]
        pooled = self.pooler(hidden, starts, lengths,
                             [np.asarray(s.prompt_token_ids) for s in states],
                             [s.pooling_params for s in states])
        self._last_sampled = None
        return StepHandle(self, req_ids, [], [], None, None, {}, None,
                          pooled=dict(zip(req_ids, pooled)))

    def _propose(self, handle: StepHandle) -> list[list[int]]:
        """Drafts for the next step of each request that sampled in ``handle``'s step (an
        empty list per request where there are none)."""
        proposals: list[list[int]] = [[] for _ in handle.req_ids]
        proposer, spec = self.proposer, self.config.speculative
        assert proposer is not None and spec is not None
        off = (spec.disable_by_batch_size is not None
               and len(self.requests) >= spec.disable_by_batch_size)
        if off and not proposer.every_step:
            return proposals
        batch, limit = self.input_batch, self.config.model.max_model_len
        at, rows, room = [], [], []
        # (a proposer that runs every step still caches this step's tokens when off)
        for i, state in ([] if off else zip(handle.sample_rows, handle.states)):
            if self.requests.get(state.req_id) is not state:
                continue
            if state.sampling_params.structured_outputs is not None:
                if not self._told_no_drafts:
                    log("speculative decoding: requests with structured output are decoded "
                        "without drafts")
                    self._told_no_drafts = True
                continue
            row = batch.index[state.req_id]
            fit = min(spec.num_speculative_tokens, limit - int(batch.num_tokens[row]) - 1)
            if fit > 0:
                at.append(i)
                rows.append(row)
                room.append(fit)
        if rows or proposer.every_step:
            for i, drafts in zip(at, proposer.propose(batch.token_ids, batch.num_tokens,
                                                      rows, room)):
                proposals[i] = drafts
        return proposals

    @property
    def overlap_safe(self) -> bool:
        """Whether the next step may be scheduled before the last launched step's ids are
        read: no request that sampled in it uses penalties, a seed, an unmet min_tokens or
        a grammar, which all depend on the tokens generated so far."""
        return self._overlap_safe

    def _sampled_sources(self, req_ids: list[str], step: StepInputs
                         ) -> tuple[torch.Tensor, list[int]]:
        """The last launched step's sampled ids, and for each of this step's tokens the
        host does not know yet (``unknown_rows``) the row of them that holds it."""
        if self._last_sampled is None:
            raise RuntimeError("a step reads tokens that no launched step sampled")
        sampled_t, index = self._last_sampled
        return sampled_t, [index[req_ids[i]] for i in step.unknown_reqs]

    def _fill_rows(self, req_ids: list[str], step: StepInputs) -> np.ndarray | None:
        """Per token of the step, the row of the last launched step's sampled ids (in the
        buffers' ``sampled``) that holds it, -1 where the host knows it; None when it
        knows all."""
        if not step.unknown_rows:
            return None
        rows = np.full(step.num_tokens, -1, dtype=np.int64)
        rows[step.unknown_rows] = self._sampled_sources(req_ids, step)[1]
        return rows

    def _copy_to_host(self, sampled: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start the copy of a step's sampled ids to the host; on CUDA into one of two
        pinned buffers (two steps may be in flight) with an event marking its end."""
        if self.device.type != "cuda":
            return sampled.clone(), None  # the next step samples into the same buffer
        self._host_flip ^= 1
        key = f"sampled{self._host_flip}"
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < sampled.numel():
            buf = torch.empty(max(sampled.numel(), 1024), dtype=torch.int64, pin_memory=True)
            self._pinned[key] = buf
        view = buf[:sampled.numel()]
        view.copy_(sampled, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return view, ready

    def _finish_step(self, handle: StepHandle) -> ModelRunnerOutput:
        """Read a launched step's sampled ids back and record them (StepHandle.result)."""
        req_ids = handle.req_ids
        if handle.pooled is not None:
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids],
                                     pooled=handle.pooled)
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[LogprobsLists | None] = []
        if handle.host_ids is not None:
            if handle.ready is not None:
                handle.ready.synchronize()  # the step's one wait
            flat = handle.host_ids.tolist()
            if handle.spec_width:  # per request: the count, then the tokens
                w = handle.spec_width
                tokens = [flat[k * w + 1:k * w + 1 + flat[k * w]]
                          for k in range(len(handle.states))]
            else:
                tokens = [[tok] for tok in flat]
            if handle.logprobs is not None:  # copied once the sampled ids are
                logprobs = [None] * len(req_ids)
                entries = handle.logprobs.to_lists()  # one per logits row
                drafts = handle.num_drafts or [0] * len(tokens)
                starts = np.cumsum([0] + [k + 1 for k in drafts]).tolist()
                for row, toks, start in zip(handle.sample_rows, tokens, starts):
                    logprobs[row] = _concat_rows(entries[start:start + len(toks)])
            batch = self.input_batch
            for row, state, toks in zip(handle.sample_rows, handle.states, tokens):
                sampled[row] = toks
                if self.requests.get(state.req_id) is not state:
                    continue  # left the batch since (finished or preempted)
                state.output_token_ids.extend(toks)
                batch.append_tokens(batch.index[state.req_id], toks)
        spec_token_ids = (self._propose(handle) if self.proposer is not None and (
            handle.host_ids is not None or self.proposer.every_step) else [])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 logprobs=logprobs, prompt_logprobs=handle.prompt_logprobs,
                                 spec_token_ids=spec_token_ids)


@dataclass
class StepHandle:
    """A launched step; ``result()`` waits for it (once) and returns its output."""

    runner: ModelRunner
    req_ids: list[str]
    sample_rows: list[int]
    states: list[CachedRequestState]
    host_ids: torch.Tensor | None  # the sampled ids' host copy (being filled)
    logprobs: SampledLogprobs | None  # the step's logprobs on the device, if asked for
    prompt_logprobs: dict[str, LogprobsLists]
    ready: torch.cuda.Event | None  # recorded after the copy to the host
    # A step with drafts: host_ids holds, per sampling request, its number of tokens and
    # then its tokens padded to this width - 1; 0 for a step of one token each.
    spec_width: int = 0
    num_drafts: list[int] | None = None  # per sampling request, in a step with drafts
    pooled: dict[str, np.ndarray] | None = None  # a pooling step's outputs, by request
    _output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self.runner._finish_step(self)
        return self._output


def _concat_rows(rows: list[LogprobsLists | None]) -> LogprobsLists | None:
    """One request's consecutive one-position logprobs as one list (None if it asked for
    none)."""
    if not rows or rows[0] is None:
        return None
    return LogprobsLists([r.token_ids[0] for r in rows if r is not None],
                         [r.logprobs[0] for r in rows if r is not None],
                         [r.ranks[0] for r in rows if r is not None])


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


def describe_cpu(dtype: torch.dtype) -> str:
    """The CPU start-up line: PyTorch's threads, the C kernels' state and how dense
    linear layers multiply."""
    line = f"CPU: {torch.get_num_threads()} threads; {cpu_kernels.status()}"
    if dtype in (torch.bfloat16, torch.float32):
        name = dtype_name(dtype)
        probe = torch.empty(0, 32, dtype=dtype)
        if cpu_packs_panels(probe):
            line += f"; dense {name} linear layers through the C kernel's packed panels"
        elif cpu_packs(probe):
            line += f"; dense {name} linear layers through oneDNN-packed weights"
        elif cpu_bf16_rows(probe):
            line += (f"; dense {name} linear layers through the C kernel, float32 products (no "
                     "oneDNN bfloat16 kernels)")
        else:
            why = "no oneDNN bfloat16 kernels" if dtype == torch.bfloat16 else "no oneDNN"
            line += f"; dense {name} linear layers through F.linear ({why})"
    return line
