"""The engine's start-up on CUDA, as ModelRunner's methods: compiling the Triton kernel
variants the start-up will launch (in worker processes, vllmpy.ops.precompile), and the
memory profile that sizes the KV pool under --gpu-memory-utilization.

Both run forwards that no request asked for: fresh prefill sequences of the step budget
(at most max_model_len tokens each, as the scheduler would send them), a decode step of
max_num_seqs rows, the largest mixed graph's step, against small scratch caches whose
slots are all padding.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import EngineConfig, log
from vllmpy.core.cache_spec import CacheSpec, RecurrentStateSpec
from vllmpy.layers.attention import Attention
from vllmpy.loader.load_stats import LoadStats
from vllmpy.models.interface import CausalLM
from vllmpy.ops.precompile import (
    KernelCompiler,
    default_num_workers,
    record_variants,
    take_started,
)
from vllmpy.sample.metadata import SamplingMetadata
from vllmpy.sample.sampler import Sampler, greedy_ids
from vllmpy.sampling_params import SamplingParams
from vllmpy.worker.cuda_graphs import StepGraphs, mixed_capture_sizes


@contextlib.contextmanager
def _first_layers(model: nn.Module, n: int) -> Iterator[None]:
    """Run the model with only its first ``n`` decoder layers (every ``layers`` ModuleList
    cut short) inside the block. The layers of the supported models are alike: past the
    first (no residual yet) each launches the same kernel variants, so recording the
    start-up's launches through two layers lists all of them, at a fraction of the
    cost."""
    cut = [(m, m.layers) for m in model.modules()
           if isinstance(getattr(m, "layers", None), nn.ModuleList)]
    for m, layers in cut:
        m.layers = layers[:n]
    try:
        yield
    finally:
        for m, layers in cut:
            m.layers = layers


class StartupMixin:
    """ModelRunner's start-up steps on CUDA (see the module docstring), over the runner's
    state below and its attention layers."""

    config: EngineConfig
    device: torch.device
    model: CausalLM | None
    block_size: int
    vocab_size: int
    sampler: Sampler
    _compiler: KernelCompiler | None
    _load_stats: LoadStats

    def _attention_layers(self) -> list[Attention]:
        raise NotImplementedError  # ModelRunner's

    def _bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        raise NotImplementedError  # ModelRunner's

    def _cache_modules(self) -> tuple[list[Any], list[CacheSpec]]:
        raise NotImplementedError  # ModelRunner's

    def _start_kernel_compiler(self) -> None:
        """The compile workers: those the engine-core process started before its imports
        (vllmpy.engine.core_launch), or new ones."""
        self._compiler = take_started()
        workers = default_num_workers()
        if self._compiler is None and workers:
            try:
                self._compiler = KernelCompiler(workers)
            except OSError as e:
                log(f"Triton kernels: could not start {workers} compile worker processes "
                    f"({e}); each kernel compiles at its first launch")

    @torch.inference_mode()
    def compile_kernels(self) -> None:
        """CUDA, at the end of ``load_model``: compile the Triton kernel variants the
        start-up will launch (the profile steps, every CUDA graph) in the worker processes
        started at its beginning, instead of one after another at their first launches.
        The forwards run once here with those launches recorded instead of run
        (vllmpy.ops.precompile)."""
        compiler, self._compiler = self._compiler, None
        if compiler is None:
            return
        assert self.model is not None
        sched = self.config.scheduler
        try:
            with self._load_stats.phase("kernel_compile"):
                tokens = sched.max_num_batched_tokens
                self._bind_kv_caches(self._scratch_caches(tokens))
                # what profile_kv_budget and capture run, through the first two layers
                with _first_layers(self.model, 2), record_variants() as variants:
                    if self.pooler is not None:  # a pooling step: the forward, no logits
                        self._profile_forward(self._fresh_seq_lens(tokens), 0)
                    else:
                        self._record_generate_steps(tokens)
                self._drop_scratch_caches()
                report = compiler.compile(variants)
        finally:
            compiler.close()
        gc.collect()
        torch.cuda.empty_cache()
        where = ", ".join(part for part in (
            f"{report.here} in this process" if report.here else "",
            f"{report.in_workers} in {compiler.num_workers} worker processes"
            if report.in_workers else "") if part)
        slowest = f"; slowest {report.slowest}" if report.slowest else ""
        log(f"Triton kernels: {report.here + report.in_workers} of {report.variants} "
            f"variants ready in {report.seconds:.2f} s ({where or 'none'}){slowest}")
        if report.failed:
            log(f"Triton kernels: the rest compile at their first launch; "
                f"{'; '.join(report.failed[:3])}")

    def _record_generate_steps(self, tokens: int) -> None:
        """The forwards (and argmaxes) a generating engine's start-up runs."""
        sched = self.config.scheduler
        logits = self._profile_forward(self._fresh_seq_lens(tokens),
                                       min(sched.max_num_seqs, tokens))
        # greedy sampling's argmax, on the head's logits and on float32 ones
        greedy_ids(logits)
        greedy_ids(logits.float())
        del logits
        if not self.config.enforce_eager:
            self._profile_forward([1] * sched.max_num_seqs, sched.max_num_seqs)
            mixed = mixed_capture_sizes(tokens)
            if mixed:
                self._profile_forward(self._fresh_seq_lens(mixed[-1]), 1)
            if self.config.cache.num_seats:  # recurrent layers read the graphs' seats
                self.buffers.enable_seats(self._scratch_seats(tokens))
            StepGraphs(self.model, self.buffers,  # type: ignore[arg-type]
                       sched.max_num_seqs, self.config.model.max_model_len,
                       sched.max_num_batched_tokens).warm_up()

    def _drop_scratch_caches(self) -> None:
        """Let go of ``_scratch_caches``' tensors (recurrent layers keep one seat each)."""
        cache = self.config.cache
        for module, spec in zip(*self._cache_modules()):
            if isinstance(spec, RecurrentStateSpec):
                module.bind_state(spec.allocate(0, self.config.model.dtype,
                                                cache.ssm_cache_dtype, self.device))
            else:
                module.kv_cache = None

    def _scratch_seats(self, tokens: int) -> int:
        """The recurrent-state seats of ``_scratch_caches``: one per request a start-up
        forward has (the scratch seat past them takes padding)."""
        return max(self.config.scheduler.max_num_seqs, len(self._fresh_seq_lens(tokens)))

    def _scratch_caches(self, tokens: int) -> list[torch.Tensor]:
        """Small caches for start-up forwards of up to ``tokens`` tokens (only padding
        slots, so nothing is ever written to them): one per paged layer; on hybrid models
        the recurrent layers get scratch seats too, one per request such a forward has."""
        cache = self.config.cache
        blocks = -(-tokens // self.block_size) + 1
        modules, specs = self._cache_modules()
        seats = self._scratch_seats(tokens)
        caches = []
        for module, spec in zip(modules, specs):
            if isinstance(spec, RecurrentStateSpec):
                module.bind_state(spec.allocate(seats, self.config.model.dtype,
                                                cache.ssm_cache_dtype, self.device))
            else:
                caches.append(torch.zeros(spec.cache_shape(blocks, self.block_size),
                                          dtype=cache.kv_cache_dtype, device=self.device))
        return caches

    @torch.inference_mode()
    def profile_kv_budget(self) -> tuple[int, str]:
        """CUDA: the bytes the KV pool may take under --gpu-memory-utilization, and how
        they were found. Runs the largest prefill step the scheduler can send (with the
        sampler on max_num_seqs random rows) and the largest decode step (what the CUDA
        graphs hold, and the largest mixed step they hold) against a small scratch cache,
        and measures their peaks."""
        assert self.model is not None and self.device.type == "cuda"
        sched, cache = self.config.scheduler, self.config.cache
        gc.collect()
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(self.device)
        tokens = sched.max_num_batched_tokens
        scratch = self._scratch_caches(tokens)
        self._bind_kv_caches(scratch)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_step(self._fresh_seq_lens(tokens), sample=min(sched.max_num_seqs, tokens))
        prefill_peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.reset_peak_memory_stats(self.device)
        graphs = 0
        if not self.config.enforce_eager:
            self._profile_step([1] * sched.max_num_seqs, sample=sched.max_num_seqs)
            graphs = torch.cuda.max_memory_allocated(self.device) - base
            mixed = mixed_capture_sizes(sched.max_num_batched_tokens)
            if mixed:  # the largest mixed graph, one request (its logits run outside)
                torch.cuda.reset_peak_memory_stats(self.device)
                self._profile_step(self._fresh_seq_lens(mixed[-1]), sample=1)
                graphs = max(graphs, torch.cuda.max_memory_allocated(self.device) - base)
        self._drop_scratch_caches()
        del scratch
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free  # weights, the CUDA context, other processes
        budget = int(total * cache.gpu_memory_utilization)
        kv_bytes = budget - in_use - prefill_peak - graphs
        gib = 2**30
        how = (f"{total / gib:.1f} GiB x {cache.gpu_memory_utilization} = {budget / gib:.2f} "
               f"GiB; in use after loading {in_use / gib:.2f} GiB (weights "
               f"{weights / gib:.2f} GiB), activation peak {prefill_peak / gib:.2f} GiB, "
               f"CUDA graphs (est.) {graphs / gib:.2f} GiB")
        return kv_bytes, how

    def _fresh_seq_lens(self, tokens: int) -> list[int]:
        """A prefill step of ``tokens`` tokens as the scheduler could send it: fresh
        sequences of at most max_model_len tokens each, so that every position falls
        inside the rotary tables (a step budget may exceed the serving length)."""
        longest = self.config.model.max_model_len
        return [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest else [])

    def _profile_forward(self, seq_lens: list[int], rows: int) -> torch.Tensor:
        """One forward of fresh sequences of ``seq_lens`` tokens against the bound scratch
        caches; returns the logits of the last ``rows`` tokens (the hidden states for
        ``rows`` 0)."""
        assert self.model is not None
        n, total = len(seq_lens), sum(seq_lens)
        dev = self.device
        query_start = [0]
        for length in seq_lens:
            query_start.append(query_start[-1] + length)
        blocks = -(-max(seq_lens) // self.block_size)
        meta = AttentionMetadata(
            num_actual_tokens=total,
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            query_start_loc_cpu=query_start,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            seq_lens_cpu=list(seq_lens),
            slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros((n, blocks), dtype=torch.int32, device=dev),
            block_size=self.block_size,
            max_query_len=max(seq_lens),
            max_seq_len=max(seq_lens),
        )
        if self.config.cache.num_seats:  # the scratch seats of _scratch_caches
            meta.state_indices = torch.arange(n, dtype=torch.int32, device=dev)
            meta.state_indices_cpu = list(range(n))
        ids = torch.zeros(total, dtype=torch.int64, device=dev)
        pos = torch.cat([torch.arange(length, device=dev) for length in seq_lens])
        hidden = self.model(ids, pos, meta)
        return hidden if rows == 0 else self.model.compute_logits(hidden[-rows:])

    def _profile_step(self, seq_lens: list[int], sample: int) -> None:
        """``_profile_forward``, then a random-sampling pass over ``sample`` rows."""
        logits = self._profile_forward(seq_lens, sample)
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        md = SamplingMetadata.build([params] * sample, [[0]] * sample, [[]] * sample,
                                    [None] * sample, [set()] * sample, self.vocab_size,
                                    self.device)
        self.sampler(logits, md)
        torch.cuda.synchronize(self.device)
