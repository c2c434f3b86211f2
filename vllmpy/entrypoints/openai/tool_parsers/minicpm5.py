"""minicpm5: MiniCPM5 writes each call as a ``function`` element with ``param`` children::

    Let me check.
    <function name="get_weather"><param name="city">Paris</param><param name="days">3</param></function>

A value with ``<``, ``&`` or a newline in it is written in a CDATA block
(``<![CDATA[...]]>``, kept verbatim); elsewhere the five XML entities and character
references are decoded. String-typed parameters stay text; the others parse as JSON or a
Python literal when they can. Text outside the elements is content.
"""

from __future__ import annotations

import re
from typing import Any

from vllmpy.entrypoints.openai.tool_parsers.xml_calls import (
    XmlCallsToolParser,
    is_string_type,
    json_or_literal,
    param_types,
)

_CDATA = re.compile(r"<!\[CDATA\[(.*?)\]\]>", re.DOTALL)
_ENTITY = re.compile(r"&(lt|gt|amp|quot|apos|#\d+|#x[0-9a-fA-F]+);")
_NAMED = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}


def xml_text(raw: str) -> str:
    """Element text as XML reads it: CDATA blocks verbatim, entities decoded elsewhere."""
    out, last = [], 0
    for match in _CDATA.finditer(raw):
        out.append(_ENTITY.sub(_entity, raw[last:match.start()]))
        out.append(match.group(1))
        last = match.end()
    out.append(_ENTITY.sub(_entity, raw[last:]))
    return "".join(out)


def _entity(match: re.Match[str]) -> str:
    name = match.group(1)
    if name in _NAMED:
        return _NAMED[name]
    return chr(int(name[2:], 16) if name[1] == "x" else int(name[1:]))


class MiniCPM5XMLToolParser(XmlCallsToolParser):
    invoke_tag = "function"
    param_tag = "param"

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, **self.xml_states()}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        if self.scan_content((self.invoke_start,), final) is None:
            return False
        self._state = "x_head"
        return True

    def convert(self, function: str, param: str, text: str) -> Any:
        value = xml_text(text)
        kinds = param_types(self.functions.get(function), param)
        if is_string_type(kinds):
            return value
        try:
            return json_or_literal(value.strip())
        except ValueError:
            return value
