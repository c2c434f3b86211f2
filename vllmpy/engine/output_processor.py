"""Frontend output handling: token deltas -> text, stop strings, logprobs, RequestOutputs.

A prompt with ``n`` completions is sent to the core as ``n`` child requests; their
outputs are gathered back into one RequestOutput per prompt here.

Logprobs arrive as plain lists (``LogprobsLists``) and become vLLM's dicts of ``Logprob``
here, each token's text decoded alone (and remembered). Prompt logprobs arrive one
prefill chunk at a time, possibly before the first token; they are placed by position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllmpy import envs
from vllmpy.core.sched_output import EngineCoreOutput, LogprobsLists
from vllmpy.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from vllmpy.sampling_params import RequestOutputKind, SamplingParams
from vllmpy.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class _ChildState:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_text_len: int = 0  # text already handed out (DELTA mode)
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Set when the request asked for logprobs: one dict per token of token_ids.
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    children: dict[str, _ChildState]
    num_cached_tokens: int = 0
    # One entry per prompt token when the request asked for prompt logprobs.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # handed out already (DELTA sends them once)
    faulty: bool = False  # its prompt holds VT_TEST_FAULT_PROMPT: processing it raises
    pooling: bool = False  # a pooling request: one output, its pooled data
    pooled: Any = None  # that data (a float32 tensor) once it came

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{index}_{parent_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_parent: dict[str, str] = {}
        self._token_texts: dict[int, str] = {}  # token id -> its text decoded alone
        # (request id, error) of requests whose processing raised: see take_failures
        self._failures: list[tuple[str, str]] = []
        self._fault_prompt = envs.VT_TEST_FAULT_PROMPT

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    child_params: list[SamplingParams], pooling: bool = False) -> list[str]:
        """Register a prompt and its n child requests (one for a ``pooling`` request);
        returns the child ids."""
        n = len(child_params)
        children: dict[str, _ChildState] = {}
        for i, params in enumerate(child_params):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               skip_special_tokens=params.skip_special_tokens)
            child_id = child_request_id(request_id, i, n)
            children[child_id] = _ChildState(i, params, detok)
            if params.logprobs is not None or params.logprob_token_ids:
                children[child_id].logprobs, children[child_id].cumulative_logprob = [], 0.0
            self.child_to_parent[child_id] = request_id
        parent = _ParentState(request_id, prompt, prompt_token_ids,
                              child_params[0].output_kind, children, pooling=pooling)
        if self._fault_prompt is not None:
            text = prompt
            if text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(prompt_token_ids)
            parent.faulty = self._fault_prompt in (text or "")
        if child_params[0].prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        self.parents[request_id] = parent
        return list(children)

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to hand out and the child ids the core must abort
        (those a stop string finished, and those of a request that failed here).

        A request whose processing raises fails alone: it is forgotten, its children are
        aborted, and ``take_failures`` reports it; the other requests go on."""
        to_abort: list[str] = []
        touched: dict[str, _ParentState] = {}
        for out in outputs:
            parent_id = self.child_to_parent.get(out.req_id)
            if parent_id is None:
                continue  # aborted by the frontend already
            parent = self.parents[parent_id]
            try:
                if self._apply(parent, out):
                    to_abort.append(out.req_id)
            except Exception as e:  # noqa: BLE001 - one request's failure stays its own
                to_abort += self._fail(parent, e)
                touched.pop(parent_id, None)
                continue
            touched[parent_id] = parent
        results = []
        for parent in touched.values():
            try:
                result = self._make_output(parent)
            except Exception as e:  # noqa: BLE001
                to_abort += self._fail(parent, e)
                continue
            if result is not None:
                results.append(result)
            if parent.finished:
                self._forget(parent)
        return results, to_abort

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, error) of every request that failed in ``process_outputs`` since
        the last call."""
        failures, self._failures = self._failures, []
        return failures

    def _apply(self, parent: _ParentState, out: EngineCoreOutput) -> bool:
        """One core output of one child; True when a stop string finished it here."""
        child = parent.children[out.req_id]
        if child.finish_reason is not None:
            return False
        if parent.faulty:
            raise RuntimeError("fault injected by VT_TEST_FAULT_PROMPT")
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.pooled_data is not None:
            import numpy as np
            import torch

            values = np.frombuffer(out.pooled_data, dtype="<f4").reshape(out.pooled_shape)
            parent.pooled = torch.from_numpy(values.copy())
        if out.new_prompt_logprobs is not None:
            self._add_prompt_logprobs(parent, child, out.new_prompt_logprobs)
        if not out.new_token_ids and not out.finished:
            return False  # a prefill chunk's prompt logprobs, nothing to hand out yet
        return self._update_child(child, out)

    def _fail(self, parent: _ParentState, error: Exception) -> list[str]:
        """Forget a request whose processing raised; returns its unfinished child ids."""
        self._failures.append((parent.request_id, f"{type(error).__name__}: {error}"))
        return self.abort(parent.request_id)

    def abort(self, request_id: str) -> list[str]:
        """Forget a prompt; returns its child ids that the core should abort."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        self._forget(parent)
        return [cid for cid, c in parent.children.items() if c.finish_reason is None]

    def _forget(self, parent: _ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for cid in parent.children:
            self.child_to_parent.pop(cid, None)

    def _update_child(self, child: _ChildState, out: EngineCoreOutput) -> bool:
        """Apply one delta. True when a stop string finished the child here.

        A delta of several tokens (speculative decoding emits them in one step) is taken
        a token at a time under stop strings, so a stop string ends the output at the
        token that completes it, as it would one token per step."""
        n = len(out.new_token_ids)
        if n <= 1 or not child.params.stop_strings or child.detokenizer is None:
            return self._update_child_delta(child, out)
        for i in range(n):
            last = i == n - 1
            lists = out.new_logprobs
            one = dataclasses.replace(
                out, new_token_ids=out.new_token_ids[i:i + 1],
                finish_reason=out.finish_reason if last else None,
                stop_reason=out.stop_reason if last else None,
                error=out.error if last else None,
                new_logprobs=None if lists is None or len(lists) <= i else LogprobsLists(
                    lists.token_ids[i:i + 1], lists.logprobs[i:i + 1], lists.ranks[i:i + 1]),
                new_prompt_logprobs=out.new_prompt_logprobs if i == 0 else None)
            if self._update_child_delta(child, one):
                return True
            if child.finish_reason is not None:
                return False
        return False

    def _update_child_delta(self, child: _ChildState, out: EngineCoreOutput) -> bool:
        params = child.params
        new_ids = out.new_token_ids
        child.token_ids.extend(new_ids)
        if child.logprobs is not None:
            self._add_logprobs(child, out.new_logprobs, len(new_ids))
        stopped_by_token = out.finish_reason == "stop"
        if child.detokenizer is not None:
            # A stop token's own text is left out unless asked for (vLLM's rule).
            detok_ids = new_ids
            if stopped_by_token and new_ids and not params.include_stop_str_in_output:
                detok_ids = new_ids[:-1]
            prev_len = len(child.text)
            child.text += child.detokenizer.add_tokens(detok_ids)
            if out.finished:
                child.text += child.detokenizer.flush()
            hit = self._find_stop_string(child, prev_len)
            if hit is not None:
                child.finish_reason, child.stop_reason = "stop", hit
                return not out.finished
        if out.finished:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _add_logprobs(self, child: _ChildState, lists: LogprobsLists | None,
                      num_new: int) -> None:
        assert child.logprobs is not None and child.cumulative_logprob is not None
        rows: list[dict[int, Logprob]] = []
        if lists is not None:
            lists = lists.head(num_new)
            rows = self._logprob_dicts(child, lists)
            child.cumulative_logprob += sum(values[0] for values in lists.logprobs)
        # A token the core appended without sampling it (none today) has no logprobs.
        rows.extend({} for _ in range(num_new - len(rows)))
        child.logprobs.extend(rows[:num_new])

    def _add_prompt_logprobs(self, parent: _ParentState, child: _ChildState,
                             lists: LogprobsLists) -> None:
        if parent.prompt_logprobs is None:
            return
        rows = self._logprob_dicts(child, lists)
        end = min(lists.start + len(rows), len(parent.prompt_logprobs))
        # Positions are absolute, so a chunk computed again (after a preemption, or by
        # another of the n completions) lands on the same entries.
        parent.prompt_logprobs[lists.start:end] = rows[:end - lists.start]

    def _logprob_dicts(self, child: _ChildState,
                       lists: LogprobsLists) -> list[dict[int, Logprob]]:
        """One dict per row: the scored token first, then the rest in their order."""
        decode = child.params.detokenize and self.tokenizer is not None
        rows: list[dict[int, Logprob]] = []
        for ids, values, ranks in zip(lists.token_ids, lists.logprobs, lists.ranks):
            row: dict[int, Logprob] = {}
            for token_id, value, rank in zip(ids, values, ranks):
                if token_id not in row:  # the scored token may be among the top ones
                    row[token_id] = Logprob(value, rank,
                                            self._token_text(token_id) if decode else None)
            rows.append(row)
        return rows

    def _token_text(self, token_id: int) -> str:
        """A token's text decoded alone, special tokens included (as vLLM shows it)."""
        text = self._token_texts.get(token_id)
        if text is None:
            assert self.tokenizer is not None
            try:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except ValueError:  # an id past the tokenizer's vocabulary (padded logits)
                text = ""
            self._token_texts[token_id] = text
        return text

    @staticmethod
    def _find_stop_string(child: _ChildState, prev_len: int) -> str | None:
        stops = child.params.stop_strings
        if not stops:
            return None
        best: tuple[int, str] | None = None
        for stop in stops:
            start = max(0, prev_len - len(stop) + 1)
            pos = child.text.find(stop, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        keep = pos + len(stop) if child.params.include_stop_str_in_output else pos
        child.text = child.text[:keep]
        return stop

    def _visible_text(self, child: _ChildState) -> str:
        """Text that can be shown now: while running, the tail that might still become a
        stop string is held back."""
        if child.finish_reason is not None or not child.params.stop_strings:
            return child.text
        hold = max(len(s) for s in child.params.stop_strings) - 1
        if child.params.include_stop_str_in_output or hold <= 0:
            return child.text
        return child.text[:max(child.sent_text_len, len(child.text) - hold)]

    def _make_output(self, parent: _ParentState) -> Any:
        if parent.pooling:
            child = next(iter(parent.children.values()))
            if child.finish_reason is None:
                return None
            if child.finish_reason != "stop" or parent.pooled is None:  # aborted / failed
                return PoolingRequestOutput(parent.request_id, PoolingOutput(None),
                                            parent.prompt_token_ids, True, parent.prompt)
            return PoolingRequestOutput(parent.request_id, PoolingOutput(parent.pooled),
                                        parent.prompt_token_ids, True, parent.prompt)
        kind = parent.kind
        if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        completions = []
        for child in parent.children.values():
            text = self._visible_text(child)
            if kind == RequestOutputKind.DELTA:
                completions.append(CompletionOutput(
                    child.index, text[child.sent_text_len:], child.token_ids[child.sent_tokens:],
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=(None if child.logprobs is None
                              else child.logprobs[child.sent_tokens:]),
                    finish_reason=child.finish_reason, stop_reason=child.stop_reason))
                child.sent_text_len, child.sent_tokens = len(text), len(child.token_ids)
            else:
                completions.append(CompletionOutput(
                    child.index, text, list(child.token_ids),
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=None if child.logprobs is None else list(child.logprobs),
                    finish_reason=child.finish_reason, stop_reason=child.stop_reason))
        completions.sort(key=lambda c: c.index)
        prompt_logprobs = (None if parent.prompt_logprobs is None
                           else list(parent.prompt_logprobs))
        if kind == RequestOutputKind.DELTA and parent.prompt_logprobs_sent:
            prompt_logprobs = None  # a stream carries them in its first output only
        parent.prompt_logprobs_sent = True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             completions, parent.finished, parent.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs)
