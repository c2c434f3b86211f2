"""dots: rednote's dots.llm writes its calls as ``invoke`` elements inside a wrapper::

    Let me check.
    <dots_function_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </dots_function_call>

A wrapper may hold several invokes, or a JSON ``{"name": ..., "arguments": {...}}`` object
instead. Parameter text is stripped and typed by the tool's schema (a parameter the
schema does not name stays text; ``null`` is null). Text outside the wrappers is content;
a wrapper that holds no call is given back as content.
"""

from __future__ import annotations

from typing import Any

from vllmpy.entrypoints.openai.tool_parsers.abstract import Tools
from vllmpy.entrypoints.openai.tool_parsers.json_stream import CallObjectReader
from vllmpy.entrypoints.openai.tool_parsers.xml_calls import (
    XmlCallsToolParser,
    param_types,
    typed_value,
)
from vllmpy.reasoning.abstract import split_at_marker

WRAP, WRAP_END = "<dots_function_call>", "</dots_function_call>"


class DotsToolParser(XmlCallsToolParser):
    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._raw = ""  # the wrapper's text while it has no call, given back if it never does
        self._calls_before = 0
        self._reader: CallObjectReader | None = None

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "wrapper": self._wrapper, "json": self._json,
                **self.xml_states()}
        while step[self._state](final):
            pass

    def convert(self, function: str, param: str, text: str) -> Any:
        text = text.strip()
        if text.lower() == "null":
            return None
        kinds = param_types(self.functions.get(function), param)
        return text if kinds is None else typed_value(text, kinds)

    def _text(self, final: bool) -> bool:
        if self.scan_content((WRAP,), final) is None:
            return False
        self._state, self._return = "wrapper", "wrapper"
        self._raw, self._calls_before = "", self.num_calls
        return True

    def _wrapper(self, final: bool) -> bool:
        """Between the calls of a wrapper: the next invoke, a JSON call, or the end."""
        stripped = self._buf.lstrip()
        if stripped.startswith("{"):
            self._raw += self._buf[:len(self._buf) - len(stripped)]
            self._buf, self._state = stripped, "json"
            self._reader = CallObjectReader(self)
            return True
        before, marker, after = split_at_marker(self._buf, (self.invoke_start, WRAP_END))
        if marker is None and not final:
            self._raw += before
            self._buf = after
            return False
        self._raw += before
        self._buf = after
        if marker == self.invoke_start:
            self._state = "x_head"
            return True
        if marker is None:  # the end of the output
            self._raw, self._buf = self._raw + self._buf, ""
        if self.num_calls == self._calls_before:  # no call: the wrapper is content
            self.emit_content(WRAP + self._raw + (marker or ""))
        self._state = "text"
        return True

    def _json(self, final: bool) -> bool:
        reader = self._reader
        assert reader is not None
        used = reader.feed(self._buf, final)
        self._raw += self._buf[:used]
        self._buf = self._buf[used:]
        if not reader.done and reader.error is None and not final:
            return False
        if not reader.done:
            reader.close()
        self._state = "wrapper"
        return True
