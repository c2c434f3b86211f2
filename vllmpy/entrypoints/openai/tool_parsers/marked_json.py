"""Calls written as JSON after a marker, the shape several families share::

    Let me check.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>

A family lists its blocks (the marker that opens one, the marker that closes it, if any,
and whether a list of calls or one call object follows), the keys its call objects use
for the name and the arguments, and markers that are dropped from the content. Text
outside the blocks is content; a block whose body is not calls is given back as content.

The readers here follow ``json_stream``'s contract (``feed`` returns the characters
consumed, ``done`` / ``error`` say how it stopped, ``close`` finishes a call cut short):

- ``NamedCallReader``: a call object whose name may sit under another key (Cohere's
  ``tool_name``);
- ``NameKeyedCallReader``: a one-key object whose key is the name and whose value is
  the arguments (Apertus: ``{"get_weather": {"city": "Paris"}}``);
- ``CallArrayReader`` (json_stream) reads a JSON array of items with any of them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.json_stream import (
    CallArrayReader,
    CallObjectReader,
    JsonValueWriter,
)
from vllmpy.reasoning.abstract import split_at_marker

_WS = " \t\r\n"


class CallReader(Protocol):
    done: bool
    error: str | None

    def feed(self, text: str, final: bool = False) -> int: ...

    def close(self) -> bool: ...


class NamedCallReader(CallObjectReader):
    """``CallObjectReader`` whose name is under any of ``name_keys``."""

    def __init__(self, parser: ToolParser, args_keys: Sequence[str],
                 name_keys: Sequence[str] = ("name",)) -> None:
        super().__init__(parser, args_keys)
        self.name_keys = tuple(name_keys)

    def _value_done(self, at: int) -> None:
        if self._key in self.name_keys:
            self._key = "name"
        super()._value_done(at)


class NameKeyedCallReader:
    """Reads ``{"<name>": {<arguments>}}``: the call opens once the key is complete and
    the arguments stream as they arrive."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.state = "open"  # open | key | colon | value | end
        self.done = False
        self.error: str | None = None
        self.call_open = False
        self._writer = JsonValueWriter()
        self._key_text = ""

    def feed(self, text: str, final: bool = False) -> int:
        i = 0
        while i < len(text) and not self.done and self.error is None:
            if self.state in ("key", "value") and self._writer.started:
                i = self._feed_writer(text, i, final)
                continue
            if text[i] in _WS:
                i += 1
                continue
            i = self._structural(text, i, final)
        return i

    def _structural(self, text: str, i: int, final: bool) -> int:
        ch = text[i]
        expected = {"open": "{", "key": '"', "colon": ":", "value": "{", "end": "}"}
        if ch != expected[self.state]:
            self.error = f"expected {expected[self.state]!r} in a name-keyed call, got {ch!r}"
            return i
        if self.state in ("key", "value"):
            return self._feed_writer(text, i, final)  # the writer reads the quote / brace
        if self.state == "end":
            self.parser.end_call()
            self.done = True
        self.state = {"open": "key", "colon": "value", "end": "end"}[self.state]
        return i + 1

    def _feed_writer(self, text: str, i: int, final: bool) -> int:
        used, written = self._writer.feed(text[i:], final)
        if self.state == "key":
            self._key_text += written
        else:
            self.parser.emit_args(written)
        if self._writer.error is not None:
            self.error = self._writer.error
        elif self._writer.done and self.state == "key":
            name = json.loads(self._key_text)
            if not name:
                self.error = "a name-keyed call has an empty name"
            else:
                self.parser.start_call(name)
                self.call_open = True
                self.state, self._writer = "colon", JsonValueWriter()
        elif self._writer.done:
            self.state = "end"
        return i + used

    def close(self) -> bool:
        """The text ended inside the object: finish the call if it was opened (True)."""
        if self.done:
            return True
        if not self.call_open:
            return False
        if self.state == "value" and self._writer.started:
            self.parser.emit_args(self._writer.close())
        elif self.state in ("colon", "value"):
            self.parser.emit_args("{}")
        self.parser.end_call()
        self.done = True
        return True


@dataclass(frozen=True)
class Block:
    start: str  # the marker that opens the block ("": the output's first character)
    end: str | None  # the marker that closes it, dropped after the calls; None: none
    openers: str = "["  # what may follow the marker: "[" a list of calls, "{" one call
    label: str = ""  # a word that may come between the marker and the calls ("json")


class MarkedJsonToolParser(ToolParser):
    """Content, then blocks of JSON calls (see the module doc)."""

    blocks: ClassVar[tuple[Block, ...]] = ()
    dropped: ClassVar[tuple[str, ...]] = ()  # markers removed wherever they occur in content
    leading: ClassVar[Block | None] = None  # a block that may open the output with no marker
    skipped: ClassVar[tuple[tuple[str, str], ...]] = ()  # (start, end) spans dropped whole
    name_keys: ClassVar[tuple[str, ...]] = ("name",)
    args_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "head" if self.leading is not None else "text"
        self._block: Block | None = None
        self._reader: CallReader | None = None
        self._raw = ""  # the block read so far, given back if it holds no call

    def make_item(self) -> CallReader:
        """The reader of one call object."""
        return NamedCallReader(self, self.args_keys, self.name_keys)

    def _parse(self, final: bool) -> None:
        step = {"head": self._head, "text": self._text, "skip": self._skip,
                "open": self._open, "calls": self._calls, "after": self._after}
        while step[self._state](final):
            pass

    def _head(self, final: bool) -> bool:
        assert self.leading is not None
        stripped = self._buf.lstrip()
        if not stripped and not final:
            return False
        if stripped[:1] and stripped[0] in self.leading.openers:
            self._block, self._raw = self.leading, self._buf[:len(self._buf) - len(stripped)]
            self._state = "open"
        else:
            self._state = "text"
        return True

    def _text(self, final: bool) -> bool:
        starts = tuple(b.start for b in self.blocks)
        spans = dict(self.skipped)
        marker = self.scan_content(starts + tuple(spans) + self.dropped, final)
        if marker is None:
            return False
        if marker in starts:
            self._block = self.blocks[starts.index(marker)]
            self._raw, self._state = marker, "open"
        elif marker in spans:
            self._raw, self._state = spans[marker], "skip"
        return True

    def _skip(self, final: bool) -> bool:
        """Inside a dropped span, up to its end marker (kept in ``_raw``)."""
        _, marker, after = split_at_marker(self._buf, (self._raw,))
        self._buf = after if marker is not None or not final else ""
        if marker is None and not final:
            return False
        self._raw, self._state = "", "text"
        self._strip_ws = True
        return True

    def _open(self, final: bool) -> bool:
        block = self._block
        assert block is not None
        stripped = self._buf.lstrip()
        if not final and (not stripped or (block.label and block.label.startswith(stripped))):
            return False
        if block.label and stripped.startswith(block.label):
            self._raw += self._buf[:len(self._buf) - len(stripped)] + block.label
            self._buf = stripped[len(block.label):]
            stripped = self._buf.lstrip()
            if not stripped and not final:
                return False
        if stripped[:1] and stripped[0] in block.openers:
            self._raw += self._buf[:len(self._buf) - len(stripped)]
            self._buf = stripped
            self._reader = (CallArrayReader(self, make_item=self.make_item)
                            if stripped[0] == "[" else self.make_item())
            self._state = "calls"
        else:
            self._give_back()
        return True

    def _calls(self, final: bool) -> bool:
        reader = self._reader
        assert reader is not None
        used = reader.feed(self._buf, final)
        self._raw += self._buf[:used]
        self._buf = self._buf[used:]
        if reader.done:
            self._state = "after"
        elif reader.error is None and not final:
            return False
        elif reader.close():
            self._state = "after"
        else:
            self._give_back()
        return True

    def _after(self, final: bool) -> bool:
        """After the calls: the block's end marker (whitespace before it is dropped)."""
        block = self._block
        assert block is not None
        self._reader, self._raw = None, ""
        end = block.end
        stripped = self._buf.lstrip()
        if end is not None:
            if not final and end.startswith(stripped):
                return False  # nothing yet, or perhaps the end marker: wait for it
            if stripped.startswith(end):
                self._buf = stripped[len(end):]
            elif final and end.startswith(stripped):
                self._buf = ""  # the end marker, cut short
        self._state = "text"
        return True

    def _give_back(self) -> None:
        """What followed the marker is not calls: the marker and it are content."""
        self.emit_content(self._raw)
        self._raw, self._reader = "", None
        self._state = "text"

