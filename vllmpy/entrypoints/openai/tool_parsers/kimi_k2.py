"""kimi_k2: Moonshot Kimi K2 writes its calls in a section, each headed by its own id::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{"q": "x"}<|tool_call_end|>
    <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>
    <|tool_calls_section_end|>

The header ``functions.<name>:<n>`` is the call's id (Kimi's chat template sends it back
with the tool's result) and names the function. A header not of that form drops its call.
Text before the section is content; a call ends the turn, so text after it is dropped.
"""

from __future__ import annotations

import re

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.json_stream import JsonValueWriter
from vllmpy.reasoning.abstract import split_at_marker

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGS = "<|tool_call_argument_begin|>"
_HEADER = re.compile(r"(.+):\d+")


def header_name(header: str) -> str | None:
    """``functions.get_weather:0`` -> ``get_weather``; None for another form."""
    match = _HEADER.fullmatch(header)
    if match is None:
        return None
    return match.group(1).removeprefix("functions.").strip() or None


class KimiK2ToolParser(ToolParser):
    needs_special_tokens = True  # the section and call markers are special tokens

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | section | header | skip | args | tail
        self._writer: JsonValueWriter | None = None
        self._next_id = ""

    def make_id(self) -> str:
        return self._next_id

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "section": self._section, "header": self._header,
                "skip": self._skip, "args": self._args, "tail": self._tail}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        if self.scan_content((SECTION,), final) is None:
            return False
        self._state = "section"
        return True

    def _section(self, final: bool) -> bool:
        """Between calls: the next call; the rest (the section's end too) is dropped."""
        _, marker, after = split_at_marker(self._buf, (CALL,))
        self._buf = "" if final and marker is None else after
        if marker is not None:
            self._state = "header"
        return marker is not None

    def _header(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (ARGS, CALL_END, SECTION_END))
        if marker is None:
            if final:
                self._buf = ""  # cut short in the header: no call
            return False
        name = header_name(before.strip())
        if name is None:
            self._state = "section" if marker != ARGS else "skip"
            self._buf = after
            return True
        self._next_id = before.strip()
        self.start_call(name)
        self._writer = JsonValueWriter()
        self._buf = after if marker == ARGS else marker + after
        self._state = "args" if marker == ARGS else "tail"
        return True

    def _skip(self, final: bool) -> bool:
        """The arguments of a dropped call."""
        _, marker, after = split_at_marker(self._buf, (CALL_END, CALL))
        self._buf = "" if final and marker is None else (
            after if marker == CALL_END else (marker or "") + after)
        if marker is not None:
            self._state = "section"
        return marker is not None

    def _args(self, final: bool) -> bool:
        writer = self._writer
        assert writer is not None
        if not self.feed_args(writer, final):
            return False
        self._state = "tail"
        return True

    def _tail(self, final: bool) -> bool:
        """After the arguments, up to the call's end marker (the rest is dropped)."""
        _, marker, after = split_at_marker(self._buf, (CALL_END, CALL, SECTION_END))
        if marker is None and not final:
            self._buf = after
            return False
        writer = self._writer
        if writer is not None and not writer.done:
            self.emit_args(writer.close() if writer.started else "{}")
        self._writer = None
        self.end_call()
        self._buf = after if marker == CALL_END else (marker or "") + after
        self._state = "section"
        return marker is not None
