"""Calls as XML elements whose name is an attribute, the shape several families share::

    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>

A family names its two tags (``invoke`` / ``parameter`` here; MiniCPM5 writes ``function``
/ ``param``, MuseGlimmer ``atem:invoke`` / ``atem:parameter``) and how a parameter's text
becomes a value (``convert``); the default types it by the tool's JSON schema. A call
opens when its start tag is complete; each parameter is sent when its end tag arrives.
Text between parameters is not part of the call. A start tag with no name is content.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, ClassVar

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools, dumps
from vllmpy.reasoning.abstract import split_at_marker

_NAME_ATTR = re.compile(r"""\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))\s*$""")
_MAX_TAG = 512  # a start tag longer than this without its '>' is not markup
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


def param_types(function: dict[str, Any] | None, param: str) -> list[str] | None:
    """The JSON-schema types of ``param`` of a tool (``anyOf`` / ``oneOf`` alternatives
    included, ``null`` last), or None when the schema does not name it."""
    properties = ((function or {}).get("parameters") or {}).get("properties") or {}
    schema = properties.get(param)
    if not isinstance(schema, dict):
        return None
    kinds: list[str] = []
    for option in [schema, *schema.get("anyOf", ()), *schema.get("oneOf", ())]:
        if not isinstance(option, dict):
            continue
        kind = option.get("type", "string" if "enum" in option else None)
        for k in kind if isinstance(kind, list) else [kind]:
            if k is not None and str(k).lower() not in kinds:
                kinds.append(str(k).lower())
    kinds.sort(key=lambda k: k == "null")
    return kinds or [""]


def is_string_type(kinds: list[str] | None) -> bool:
    return kinds is not None and any(k in _STRING_TYPES for k in kinds)


def json_or_literal(text: str) -> Any:
    """``text`` as JSON, else as a Python literal JSON can hold; raises ValueError."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(f"not a JSON or Python literal: {text[:40]!r}") from None
    return value


def typed_value(text: str, kinds: list[str] | None) -> Any:
    """A parameter's text as the value its schema types call for: strings stay text,
    integers / numbers / booleans / null parse as such, anything else (and a parameter
    without a schema) parses as JSON or a Python literal; what does not parse stays text."""
    if is_string_type(kinds):
        return text
    stripped = text.strip()
    for kind in kinds or [""]:
        try:
            if kind in ("integer", "int"):
                return int(stripped)
            if kind in ("number", "float"):
                number = json.loads(stripped)
                if isinstance(number, (int, float)) and not isinstance(number, bool):
                    return number
            elif kind in ("boolean", "bool") and stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            elif kind == "null" and stripped.lower() in ("null", "none"):
                return None
            elif kind not in ("integer", "int", "number", "float", "boolean", "bool", "null"):
                return json_or_literal(stripped)
        except ValueError:
            continue
    return text


class XmlCallsToolParser(ToolParser):
    """The element reader, as parser states over ``self._buf``; a family's ``_parse``
    steps through ``xml_states()`` plus its own, and enters the reader by setting
    ``self._state = "x_head"`` right after the ``<invoke `` of a start tag."""

    invoke_tag: ClassVar[str] = "invoke"
    param_tag: ClassVar[str] = "parameter"

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"
        self._return = "text"  # the state after an element
        self._function = ""
        self._param = ""
        self._params = 0

    @property
    def invoke_start(self) -> str:
        return f"<{self.invoke_tag} "

    def xml_states(self) -> dict[str, Any]:
        return {"x_head": self._x_head, "x_body": self._x_body, "x_phead": self._x_phead,
                "x_pvalue": self._x_pvalue}

    # -- a family's hooks -------------------------------------------------------------------

    def call_name(self, name: str) -> str:
        """The function name for the one the start tag gives."""
        return name

    def convert(self, function: str, param: str, text: str) -> Any:
        return typed_value(text, param_types(self.functions.get(function), param))

    # -- the reader -------------------------------------------------------------------------

    def _tag_rest(self, final: bool) -> str | None:
        """The rest of a start tag up to its '>' (consumed), or None: waiting, or the
        tag is not markup (then ``self._state`` is set to give it back)."""
        at = self._buf.find(">")
        if at < 0 and not final and len(self._buf) <= _MAX_TAG:
            return None
        if at < 0:  # not markup: the tag's start is content, the rest is read again
            self.emit_content(self.invoke_start)
            self._state = self._return
            return None
        rest, self._buf = self._buf[:at], self._buf[at + 1:]
        return rest

    def _x_head(self, final: bool) -> bool:
        rest = self._tag_rest(final)
        if rest is None:
            return self._state != "x_head"
        match = _NAME_ATTR.match(" " + rest)
        name = next((g for g in match.groups() if g), "") if match else ""
        if not name.strip():
            self.emit_content(self.invoke_start + rest + ">")
            self._state = self._return
            return True
        self._function, self._params = self.call_name(name.strip()), 0
        self.start_call(self._function)
        self._state = "x_body"
        return True

    def _x_body(self, final: bool) -> bool:
        param_start, end = f"<{self.param_tag} ", f"</{self.invoke_tag}>"
        _, marker, after = split_at_marker(self._buf, (param_start, end))
        if marker is None:
            self._buf = "" if final else after
            if final:
                self._end_invoke()
            return final
        self._buf = after
        if marker == end:
            self._end_invoke()
        else:
            self._state = "x_phead"
        return True

    def _x_phead(self, final: bool) -> bool:
        at = self._buf.find(">")
        if at < 0:
            if final:  # cut short inside a parameter's start tag: the call ends without it
                self._buf = ""
                self._end_invoke()
            return final
        match = _NAME_ATTR.match(" " + self._buf[:at])
        self._param = next((g for g in match.groups() if g), "") if match else ""
        self._buf = self._buf[at + 1:]
        self._state = "x_pvalue"
        return True

    def _x_pvalue(self, final: bool) -> bool:
        end = f"</{self.param_tag}>"
        before, marker, after = split_at_marker(self._buf, (end, f"</{self.invoke_tag}>"))
        if marker is None and not final:
            return False
        if marker is None:
            before, after = before + after, ""
        if self._param:
            value = self.convert(self._function, self._param, before)
            self.emit_args(("{" if self._params == 0 else ", ") + dumps(self._param) + ": "
                           + dumps(value))
            self._params += 1
        self._buf = after if marker == end else (marker or "") + after
        self._state = "x_body"
        return True

    def _end_invoke(self) -> None:
        self.emit_args("{}" if self._params == 0 else "}")
        self.end_call()
        self._state = self._return
