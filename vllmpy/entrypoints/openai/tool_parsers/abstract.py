"""The tool parser interface: generated text in, content and tool-call deltas out.

One parser instance reads one generated sequence, fed in pieces as a stream arrives. A
whole response is parsed the same way (one piece, then ``finish``), so a stream and a
whole response always agree. The deltas keep OpenAI's streaming rules:

- a call's ``id`` and function ``name`` come once, on the first delta of that call;
- call indexes start at 0 and only increase;
- a call's ``arguments`` fragments concatenate to one valid JSON text (a call cut short by
  the end of generation is closed so that it still parses).

Whitespace next to tool-call markup is not content. Text that only looked like the start
of a call and turned out not to be one is given back as content.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllmpy.entrypoints.openai.protocol import random_id
from vllmpy.reasoning.abstract import split_at_marker

# the request's tool definitions, as sent: [{"type": "function", "function": {...}}, ...]
Tools = Sequence[dict[str, Any]] | None


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on the first delta of the call only
    name: str | None = None  # likewise
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """A whole response: the content (None when there is none) and the calls."""

    content: str | None
    tool_calls: list[ParsedToolCall]


class ToolParser:
    """Base class; a family implements ``_parse``, which consumes ``self._buf`` as far as it
    can (all of it when ``final``) through the ``emit_*`` / ``start_call`` helpers.

    ``tools`` are the request's tool definitions (``{"type": "function", "function":
    {...}}``); parsers that convert argument types read the parameter schemas from them.
    """

    # the family's markers are special tokens, so detokenizing must keep special tokens
    needs_special_tokens: ClassVar[bool] = False
    # the family frames every message (channel formats): the parser reads the whole output,
    # reasoning messages included, and its content is the answer's (the reasoning parser
    # then only supplies reasoning_content)
    reads_messages: ClassVar[bool] = False

    def __init__(self, tools: Tools = None) -> None:
        self.functions: dict[str, dict[str, Any]] = {}
        for tool in tools or ():
            function = tool.get("function") or {}
            if isinstance(function.get("name"), str):
                self.functions[function["name"]] = function
        self._buf = ""
        self._held_ws = ""  # trailing whitespace of the content, kept until text follows
        self._strip_ws = False  # drop leading whitespace (right after a call's markup)
        self._delta = ParsedDelta()
        self.num_calls = 0
        self.in_call = False

    # -- the interface ----------------------------------------------------------------------

    def push(self, text: str) -> ParsedDelta:
        """Feed the next piece of generated text; returns what is certain now."""
        self._buf += text
        self._parse(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        """The end of generation: flush held text and close an unfinished call."""
        self._parse(final=True)
        if self.in_call:
            self.end_call()
        if self._held_ws and not self._strip_ws:
            self._delta.content += self._held_ws
        self._held_ws = ""
        return self._take()

    def parse(self, text: str) -> ParsedOutput:
        """A whole response at once."""
        deltas = [self.push(text), self.finish()]
        return collect(deltas)

    def _parse(self, final: bool) -> None:
        raise NotImplementedError

    # -- helpers for the families -----------------------------------------------------------

    def make_id(self) -> str:
        return random_id("chatcmpl-tool")

    def emit_content(self, text: str) -> None:
        if self._strip_ws:
            text = text.lstrip()
            if not text:
                return
            self._strip_ws = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        self._delta.content += body

    def start_call(self, name: str) -> None:
        """Open call number ``num_calls``; whitespace before its markup is dropped."""
        if self.in_call:
            self.end_call()
        self._held_ws = ""
        self._strip_ws = False
        self._delta.tool_calls.append(ToolCallDelta(self.num_calls, self.make_id(), name))
        self.num_calls += 1
        self.in_call = True

    def emit_args(self, fragment: str) -> None:
        if not fragment:
            return
        call = self._delta.tool_calls[-1] if self._delta.tool_calls else None
        if call is None or call.index != self.num_calls - 1:
            call = ToolCallDelta(self.num_calls - 1)
            self._delta.tool_calls.append(call)
        call.arguments += fragment

    def feed_args(self, writer: Any, final: bool) -> bool:
        """Stream the buffer through ``writer`` (a ``JsonValueWriter``) as the open call's
        arguments; True once the value has ended: complete, stopped being JSON, or cut
        short by the end of generation."""
        used, written = writer.feed(self._buf, final)
        self.emit_args(written)
        self._buf = self._buf[used:]
        return writer.done or writer.error is not None or final

    def end_call(self) -> None:
        self.in_call = False
        self._strip_ws = True

    def scan_content(self, markers: Sequence[str], final: bool) -> str | None:
        """Emit the buffer as content up to the earliest marker and consume the marker;
        returns it, or None when no marker is there (a possible marker start is kept in
        the buffer unless ``final``)."""
        before, marker, after = split_at_marker(self._buf, markers)
        self.emit_content(before)
        if marker is None and final:
            self.emit_content(after)
            after = ""
        self._buf = after
        return marker

    def _take(self) -> ParsedDelta:
        delta, self._delta = self._delta, ParsedDelta()
        return delta


def collect(deltas: Sequence[ParsedDelta]) -> ParsedOutput:
    """Assemble stream deltas into a whole response."""
    content = "".join(d.content for d in deltas)
    calls: list[ParsedToolCall] = []
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                calls.append(ParsedToolCall(c.id, c.name or "", c.arguments))
            else:
                calls[c.index].arguments += c.arguments
    return ParsedOutput(content or None, calls)


def mistral_call_id() -> str:
    """Mistral's tool-call id: 9 letters and digits (its chat templates check the length)."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def dumps(value: Any) -> str:
    """JSON text as the arguments are written: json.dumps spacing, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)
