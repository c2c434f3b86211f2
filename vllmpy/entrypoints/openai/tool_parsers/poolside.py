"""poolside_v1: poolside's Laguna models write each call as the function name and key /
value pairs between ``<tool_call>`` tags (the GLM-4.5 layout)::

    Let me check.<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A value whose parameter the tool's schema types as a string is kept verbatim (whitespace
included); any other value is read as JSON, else as a Python literal, else kept as text.
Text outside the tags is content; a ``<tool_call>`` not followed by a name is content.
"""

from __future__ import annotations

from typing import Any

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools, dumps
from vllmpy.entrypoints.openai.tool_parsers.xml_calls import (
    is_string_type,
    json_or_literal,
    param_types,
)
from vllmpy.reasoning.abstract import split_at_marker

CALL, CALL_END = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
_MAX_NAME = 256


class PoolsideV1ToolParser(ToolParser):
    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | name | body | key | value
        self._function = ""
        self._key = ""
        self._params = 0

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "name": self._name, "body": self._body,
                "key": self._read_key, "value": self._value}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        if self.scan_content((CALL,), final) is None:
            return False
        self._state = "name"
        return True

    def _name(self, final: bool) -> bool:
        """The name runs to the end of its line or the first tag."""
        before, marker, _ = split_at_marker(self._buf, ("\n", KEY, CALL_END))
        if marker is None and not final and len(before) <= _MAX_NAME:
            return False
        name = before.strip()
        if not name or len(name) > _MAX_NAME or "<" in name:
            self.emit_content(CALL)  # not a call: the tag is content
            self._state = "text"
            return True
        self._buf = self._buf[len(before):].removeprefix("\n")
        self._function, self._params = name, 0
        self.start_call(name)
        self._state = "body"
        return True

    def _body(self, final: bool) -> bool:
        _, marker, after = split_at_marker(self._buf, (KEY, CALL_END))
        self._buf = after if marker is not None or not final else ""
        if marker is None and not final:
            return False
        if marker == KEY:
            self._state = "key"
        else:
            self.emit_args("{}" if self._params == 0 else "}")
            self.end_call()
            self._state = "text"
        return True

    def _read_key(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (KEY_END,))
        if marker is None and not final:
            return False
        stripped = after.lstrip()
        if marker is not None and not final and VALUE.startswith(stripped):
            return False  # the value's tag is not complete yet
        if marker is None or not stripped.startswith(VALUE):
            self._buf = "" if marker is None else after  # a key with no value is dropped
            self._state = "body"
            return True
        self._key, self._buf = before.strip(), stripped[len(VALUE):]
        self._state = "value"
        return True

    def _value(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (VALUE_END, CALL_END))
        if marker is None and not final:
            return False
        if marker is None:
            before, after = before + after, ""
        self.emit_args(("{" if self._params == 0 else ", ") + dumps(self._key) + ": "
                       + dumps(self._convert(before)))
        self._params += 1
        self._buf = after if marker == VALUE_END else (marker or "") + after
        self._state = "body"
        return True

    def _convert(self, text: str) -> Any:
        if is_string_type(param_types(self.functions.get(self._function), self._key)):
            return text
        try:
            return json_or_literal(text.strip())
        except ValueError:
            return text
