"""LLM: the synchronous library API over an in-process engine core (vLLM's ``LLM``)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import fields, replace
from typing import Any

import torch

from vllmpy.config import EngineArgs
from vllmpy.engine.configure import build_engine_config, model_source
from vllmpy.engine.core_client import InprocClient
from vllmpy.engine.input_processor import InputProcessor, PromptType
from vllmpy.engine.output_processor import OutputProcessor
from vllmpy.loader.load_stats import LoadStats
from vllmpy.loader.source import load_tokenizer
from vllmpy.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vllmpy.pooling.params import PoolingParams
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

    # ---- pooling --------------------------------------------------------------------------

    def _add_pooling(self, processed: Any) -> None:
        request_id = processed.core_requests[0].request_id
        self.output_processor.add_request(request_id, processed.prompt,
                                          processed.prompt_token_ids, processed.child_params,
                                          pooling=True)
        self._metrics[request_id] = RequestMetrics(
            arrival_time=processed.core_requests[0].arrival_time,
            num_prompt_tokens=len(processed.prompt_token_ids))
        self.engine.add_request(processed.core_requests[0])

    def _run_pooling(self, items: list[tuple[PromptType, PoolingParams, str | None]],
                     use_tqdm: bool) -> list[PoolingRequestOutput]:
        """Queue every (prompt, params, pair) and run them; outputs in input order. Every
        input is checked before any is queued, and they are queued shortest first, as
        sentence-transformers batches them: a step then holds prompts of similar length
        (one attention group, little padding)."""
        processed = self.input_processor.process_pooling_batch(
            [(str(next(self._counter)), prompt, params, pair) for prompt, params, pair in items])
        order: dict[str, int] = {}
        try:
            for i in sorted(range(len(items)),
                            key=lambda i: len(processed[i].prompt_token_ids)):
                self._add_pooling(processed[i])
                order[processed[i].core_requests[0].request_id] = i
        except Exception:
            self._abort_all(list(order))
            raise
        results: list[PoolingRequestOutput | None] = [None] * len(items)
        bar = _progress(len(items)) if use_tqdm else None
        while self.output_processor.has_unfinished():
            for out in self._step():
                if out.finished:
                    if out.outputs.data is None:
                        self._abort_all(list(order))
                        raise RuntimeError(f"pooling request {out.request_id!r} failed in "
                                           f"the engine")
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [r for r in results if r is not None]

    def _pooling_items(self, prompts: PromptType | Sequence[PromptType],
                       pooling_params: PoolingParams | Sequence[PoolingParams] | None,
                       task: str, truncate_prompt_tokens: int | None
                       ) -> list[tuple[PromptType, PoolingParams, str | None]]:
        prompt_list, _ = self._normalize(prompts, None)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            base = pooling_params or PoolingParams(task=task)
            params_list = [base] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} pooling params for "
                                 f"{len(prompt_list)} prompts")
        items = []
        for prompt, params in zip(prompt_list, params_list):
            params = dataclasses.replace(params, task=task)
            if truncate_prompt_tokens is not None:
                params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
            items.append((prompt, params, None))
        return items

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
               ) -> list[PoolingRequestOutput]:
        """The pooling model's raw output per prompt (vLLM's ``LLM.encode``): the hidden
        state of every token (ALL pooling), or of the step tokens (STEP)."""
        return self._run_pooling(self._pooling_items(prompts, pooling_params, "encode",
                                                     truncate_prompt_tokens), use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``); ``pooling_params`` may set
        ``dimensions`` and ``normalize``."""
        outs = self._run_pooling(self._pooling_items(prompts, pooling_params, "embed",
                                                     truncate_prompt_tokens), use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()),
                                       o.prompt_token_ids) for o in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (vLLM's ``LLM.classify``)."""
        outs = self._run_pooling(self._pooling_items(prompts, pooling_params, "classify",
                                                     truncate_prompt_tokens), use_tqdm)
        return [ClassificationRequestOutput(o.request_id,
                                            ClassificationOutput(o.outputs.data.tolist()),
                                            o.prompt_token_ids) for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Relevance of each text pair (vLLM's ``LLM.score``): ``data_1`` one text against
        every text of ``data_2``, or the two lists pairwise. A cross-encoder scores each
        pair in one forward; an embedding model scores by the cosine of the two
        embeddings."""
        pairs = score_pairs(data_1, data_2)
        params = dataclasses.replace(pooling_params or PoolingParams(), task="score",
                                     truncate_prompt_tokens=truncate_prompt_tokens)
        from vllmpy.pooling import model_tasks

        if "classify" in model_tasks(self.config.model):
            outs = self._run_pooling([(a, params, b) for a, b in pairs], use_tqdm)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])),
                                         o.prompt_token_ids) for o in outs]
        self.input_processor.check_task("score")
        embed = dataclasses.replace(params, task="embed")
        texts = [t for pair in pairs for t in pair]
        outs = self._run_pooling([(t, embed, None) for t in texts], use_tqdm)
        results = []
        for k in range(len(pairs)):
            a, b = outs[2 * k], outs[2 * k + 1]
            score = float(torch.nn.functional.cosine_similarity(
                a.outputs.data, b.outputs.data, dim=0))
            results.append(ScoringRequestOutput(a.request_id, ScoringOutput(score),
                                                a.prompt_token_ids + b.prompt_token_ids))
        return results

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


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]
                ) -> list[tuple[str, str]]:
    """vLLM's pairing of score inputs: one text against each of a list, or two lists of
    the same length pairwise."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side")
    for t in first + second:
        if not isinstance(t, str):
            raise ValueError(f"score inputs must be texts, got {type(t).__name__}")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"score takes one text against many, or two lists of the same "
                         f"length; got {len(first)} and {len(second)} texts")
    return list(zip(first, second))
