"""Frontend output handling: token deltas -> text, stop strings, RequestOutputs.

A prompt with ``n`` completions is sent to the core as ``n`` child requests; their
outputs are gathered back into one RequestOutput per prompt here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllmpy.core.sched_output import EngineCoreOutput
from vllmpy.outputs import CompletionOutput, RequestOutput
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


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    children: dict[str, _ChildState]
    num_cached_tokens: int = 0

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

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    child_params: list[SamplingParams]) -> list[str]:
        """Register a prompt and its n child requests; returns the child ids."""
        n = len(child_params)
        children: dict[str, _ChildState] = {}
        for i, params in enumerate(child_params):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               skip_special_tokens=params.skip_special_tokens)
            child_id = child_request_id(request_id, i, n)
            children[child_id] = _ChildState(i, params, detok)
            self.child_to_parent[child_id] = request_id
        self.parents[request_id] = _ParentState(request_id, prompt, prompt_token_ids,
                                                child_params[0].output_kind, children)
        return list(children)

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to hand out and the child ids the core must abort
        (those a stop string finished)."""
        to_abort: list[str] = []
        touched: dict[str, _ParentState] = {}
        for out in outputs:
            parent_id = self.child_to_parent.get(out.req_id)
            if parent_id is None:
                continue  # aborted by the frontend already
            parent = self.parents[parent_id]
            child = parent.children[out.req_id]
            if child.finish_reason is not None:
                continue
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if self._update_child(child, out):
                to_abort.append(out.req_id)
            touched[parent_id] = parent
        results = []
        for parent in touched.values():
            result = self._make_output(parent)
            if result is not None:
                results.append(result)
            if parent.finished:
                self._forget(parent)
        return results, to_abort

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
        """Apply one delta. True when a stop string finished the child here."""
        params = child.params
        new_ids = out.new_token_ids
        child.token_ids.extend(new_ids)
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

    def _make_output(self, parent: _ParentState) -> RequestOutput | None:
        kind = parent.kind
        if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        completions = []
        for child in parent.children.values():
            text = self._visible_text(child)
            if kind == RequestOutputKind.DELTA:
                completions.append(CompletionOutput(
                    child.index, text[child.sent_text_len:], child.token_ids[child.sent_tokens:],
                    finish_reason=child.finish_reason, stop_reason=child.stop_reason))
                child.sent_text_len, child.sent_tokens = len(text), len(child.token_ids)
            else:
                completions.append(CompletionOutput(
                    child.index, text, list(child.token_ids),
                    finish_reason=child.finish_reason, stop_reason=child.stop_reason))
        completions.sort(key=lambda c: c.index)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             completions, parent.finished, parent.num_cached_tokens)
