"""LLM: the synchronous library API over an in-process engine core (vLLM's ``LLM``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import fields, replace
from typing import Any

from vllmpy.config import EngineArgs
from vllmpy.engine.configure import build_engine_config, model_source
from vllmpy.engine.core_client import InprocClient
from vllmpy.engine.input_processor import InputProcessor, PromptType
from vllmpy.engine.output_processor import OutputProcessor
from vllmpy.loader.load_stats import LoadStats
from vllmpy.loader.source import load_tokenizer
from vllmpy.outputs import RequestMetrics, RequestOutput
from vllmpy.sampling_params import RequestOutputKind, SamplingParams
from vllmpy.structured_output import validate_structured_outputs

Message = dict[str, Any]


class LLM:
    """``LLM(model=None, **engine_args)``: ``model`` is a model directory, a .gguf file, a
    Hugging Face repo id, or None for the embedded default model. Every other keyword is an
    ``EngineArgs`` field (block_size, num_blocks, max_model_len, dtype, device, ...)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine argument(s): {', '.join(unknown)}")
        self.engine_args = args = EngineArgs(model=model, **kwargs)
        stats = LoadStats()
        with stats.phase("config"):
            self.source = model_source(args)
            self.config = build_engine_config(args, self.source)
        with stats.phase("tokenizer"):
            self.tokenizer = load_tokenizer(self.source, args.tokenizer_config,
                                            skip=args.skip_tokenizer_init)
        stats.report()
        self.input_processor = InputProcessor(self.config.model, self.tokenizer,
                                              self.config.scheduler.policy)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine = InprocClient(self.config, self.source)
        self.config = self.engine.engine_core.config  # with the pool as the core sized it
        self._counter = itertools.count()
        self._metrics: dict[str, RequestMetrics] = {}  # per unfinished request

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- requests -----------------------------------------------------------------------

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams,
                    priority: int = 0) -> str:
        """Queue one prompt without waiting for it (vLLM's ``LLMEngine.add_request``);
        returns its request id. Drive it with ``step()``; its outputs come as
        ``sampling_params.output_kind`` asks."""
        return self._add_request(prompt, sampling_params, priority)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the RequestOutputs it produced (vLLM's
        ``LLMEngine.step``). Each carries ``metrics``."""
        return self._step()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``LLM.reset_prefix_cache``). False, with
        nothing reset, while requests hold KV blocks or with prefix caching off."""
        return self.engine.engine_core.reset_prefix_cache()

    def _add_request(self, prompt: PromptType, params: SamplingParams,
                     priority: int = 0) -> str:
        validate_structured_outputs(params.structured_outputs, self.tokenizer is not None)
        request_id = str(next(self._counter))
        processed = self.input_processor.process_prompt(request_id, prompt, params,
                                                        priority=priority)
        self.output_processor.add_request(request_id, processed.prompt,
                                          processed.prompt_token_ids, processed.child_params)
        self._metrics[request_id] = RequestMetrics(
            arrival_time=processed.core_requests[0].arrival_time,
            num_prompt_tokens=len(processed.prompt_token_ids))
        for req in processed.core_requests:
            self.engine.add_request(req)
        return request_id

    def _step(self) -> list[RequestOutput]:
        batch = self.engine.get_output()
        core_outputs = batch.outputs
        if not core_outputs and not self.engine.has_unfinished_requests():
            raise RuntimeError("the engine core has no requests left but the frontend still "
                               "waits for some; this is a bug")
        self._record_token_times(batch.outputs, batch.timestamp)
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        failures = self.output_processor.take_failures()
        if to_abort:
            self.engine.abort_requests(to_abort)
        if failures:
            request_id, error = failures[0]
            self._metrics.pop(request_id, None)
            raise RuntimeError(f"request {request_id!r} failed while its output was "
                               f"processed: {error}")
        for out in outputs:
            out.metrics = self._take_metrics(out.request_id, out.finished, batch.timestamp)
        return outputs

    def _record_token_times(self, core_outputs: list, now: float) -> None:
        """Token timing per request, as AsyncLLM keeps it: one interval per request and
        step that produced tokens (``now`` is the step's end, time.time())."""
        timed: set[str] = set()
        for out in core_outputs:
            parent_id = self.output_processor.child_to_parent.get(out.req_id)
            m = self._metrics.get(parent_id) if parent_id is not None else None
            if parent_id is None or m is None:
                continue
            m.observe_step(out.first_scheduled_time, len(out.new_token_ids), now,
                           parent_id not in timed)
            if out.new_token_ids:
                timed.add(parent_id)

    def _take_metrics(self, request_id: str, finished: bool, now: float
                      ) -> RequestMetrics | None:
        """A snapshot for one handed-out output; its intervals are not handed out again."""
        m = self._metrics.pop(request_id, None) if finished else self._metrics.get(request_id)
        if m is None:
            return None
        snapshot = replace(m, finished_time=now if finished else None)
        m.inter_token_latencies = []
        return snapshot

    def _normalize(self, prompts: PromptType | Sequence[PromptType],
                   sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                   ) -> tuple[list[PromptType], list[SamplingParams]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompt_list: list[PromptType] = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling params for "
                                 f"{len(prompt_list)} prompts")
        return prompt_list, params_list

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 ) -> list[RequestOutput]:
        """Generate completions for prompts (text, token-id lists, or vLLM's prompt dicts);
        one RequestOutput per prompt, in input order. ``use_tqdm`` shows a progress bar on
        stderr, as vLLM does. ``priority``: one per prompt (lower first), only with
        ``scheduling_policy="priority"``."""
        prompt_list, params_list = self._normalize(prompts, sampling_params)
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        order: dict[str, int] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                final = params.clone()
                final.output_kind = RequestOutputKind.FINAL_ONLY
                order[self._add_request(prompt, final, priorities[i])] = i
        except Exception:
            self._abort_all(list(order))
            raise
        results: list[RequestOutput | None] = [None] * len(prompt_list)
        bar = _progress(len(prompt_list)) if use_tqdm else None
        while self.output_processor.has_unfinished():
            for out in self._step():
                if out.finished:
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [r for r in results if r is not None]

    def generate_stream(self, prompt: PromptType,
                        sampling_params: SamplingParams | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield RequestOutputs carrying only what is new (DELTA) as tokens arrive."""
        params = (sampling_params or SamplingParams()).clone()
        params.output_kind = RequestOutputKind.DELTA
        request_id = self._add_request(prompt, params)
        try:
            while self.output_processor.has_unfinished():
                for out in self._step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self._abort_all([request_id])

    def _abort_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._metrics.pop(rid, None)
            child_ids = self.output_processor.abort(rid)
            if child_ids:
                self.engine.abort_requests(child_ids)

    # ---- chat ---------------------------------------------------------------------------

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render chat messages")
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template and generate."""
        conversations = ([messages] if messages and isinstance(messages[0], dict)
                         else messages)
        prompts: list[PromptType] = [
            self.render_chat(conv, add_generation_prompt, continue_final_message,  # type: ignore[arg-type]
                             chat_template_kwargs)
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="prompt")
