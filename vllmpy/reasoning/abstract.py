"""The reasoning parser interface, and the marker scanning every streaming parser shares.

A reasoning parser splits a model's generated text into ``reasoning_content`` (the thinking
block) and ``content`` (the answer). It is fed the text in pieces, as a stream arrives, and
gives the same split whatever the pieces are: a marker cut across two pieces is held back
until it can be told apart from ordinary text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar


def split_at_marker(text: str, markers: Sequence[str]) -> tuple[str, str | None, str]:
    """Find the earliest of ``markers`` in ``text``.

    Returns ``(before, marker, after)`` when one occurs (the first listed wins a tie), and
    otherwise ``(safe, None, held)``: ``held`` is the longest tail of ``text`` that is the
    beginning of a marker (it must wait for more text), ``safe`` is everything before it.
    """
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, marker)
    if best is not None:
        at, marker = best
        return text[:at], marker, text[at + len(marker):]
    hold = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:size]):
                hold = size
                break
    return text[:len(text) - hold], None, text[len(text) - hold:]


def prompt_think_state(prompt_tail: str, start: str, end: str) -> str | None:
    """'open' when the rendered prompt ends inside a thinking block the template opened
    (the model continues it), 'closed' when it ends right after one it closed (thinking
    was switched off), None otherwise."""
    tail = prompt_tail.rstrip()
    if tail.endswith(start):
        return "open"
    if tail.endswith(end):
        return "closed"
    return None


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One instance per generated sequence.

    Contract: ``push(text)`` returns the reasoning and content that are certain after
    ``text`` arrives; ``finish()`` returns what was held back. The concatenated results
    are the same however the text is cut into pieces. A thinking block is recognized only
    at the start of the output (or opened by the prompt); once it ends, everything after
    it is content, with the whitespace right after the end marker dropped.

    Subclasses set the markers and choose the first mode in ``initial_mode``. The modes
    are methods named ``_mode_<name>``; a family with its own grammar adds modes of its
    own or overrides one (each returns True when the mode changed, so the loop steps
    again, and False when it needs more text).
    """

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # markers that end the thinking block and stay in the content (a tool call, say)
    content_starts: ClassVar[tuple[str, ...]] = ()
    # markers removed wherever they occur inside the thinking block
    dropped_in_reasoning: ClassVar[tuple[str, ...]] = ()
    # the mode "head" falls back to when the output does not open a thinking block
    head_fallback: ClassVar[str] = "content"
    # the markers are special tokens in this family's vocabulary, so detokenizing must
    # keep special tokens for the parser to see them
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, *, prompt_tail: str = "", enable_thinking: bool | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.enable_thinking = enable_thinking
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # "head": content, but a thinking block may open here; "reasoning_head": reasoning
        # whose optional repeated start marker is dropped; "reasoning"; "after": whitespace
        # after the end marker; "content"
        self._mode = self.initial_mode(prompt_think_state(prompt_tail, self.start, self.end))
        self._buf = ""

    def initial_mode(self, prompt_state: str | None) -> str:
        raise NotImplementedError

    def push(self, text: str) -> ReasoningDelta:
        self._buf += text
        out = ReasoningDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        while self._step(out, final=True):
            pass
        return out

    def _step(self, out: ReasoningDelta, final: bool) -> bool:
        """Consume what the current mode can; True when the mode changed (step again)."""
        return getattr(self, f"_mode_{self._mode}")(out, final)

    def _mode_head(self, out: ReasoningDelta, final: bool) -> bool:
        return self._open_or(final, self.head_fallback)

    def _mode_reasoning_head(self, out: ReasoningDelta, final: bool) -> bool:
        return self._open_or(final, "reasoning")

    def _open_or(self, final: bool, otherwise: str) -> bool:
        """Enter "reasoning" past a leading start marker, else ``otherwise`` (the text
        kept whole); False while the text may still be the start marker."""
        stripped = self._buf.lstrip()
        if stripped.startswith(self.start):
            self._buf = stripped[len(self.start):]
            self._mode = "reasoning"
            return True
        if not final and (not stripped or self.start.startswith(stripped)):
            return False  # still might be the start marker
        self._mode = otherwise
        return True

    def _mode_reasoning(self, out: ReasoningDelta, final: bool) -> bool:
        markers = (self.end, *self.content_starts, *self.dropped_in_reasoning)
        before, marker, after = split_at_marker(self._buf, markers)
        if marker is None:
            out.reasoning += before + (after if final else "")
            self._buf = "" if final else after
            return False
        out.reasoning += before
        if marker in self.dropped_in_reasoning:
            self._buf = after
            return True
        self._buf = after if marker == self.end else marker + after
        self._mode = "after"
        return True

    def _mode_after(self, out: ReasoningDelta, final: bool) -> bool:
        self._buf = self._buf.lstrip()
        if self._buf:
            self._mode = "content"
            return True
        return False

    def _mode_content(self, out: ReasoningDelta, final: bool) -> bool:
        out.content += self._buf
        self._buf = ""
        return False
