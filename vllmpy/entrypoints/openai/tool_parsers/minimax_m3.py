"""minimax_m3: MiniMax-M3 marks every tag of its calls with ``]<]minimax[>[`` (written
``§`` here), and writes each argument as an element named after it, nesting objects and
arrays as child elements (an array's items are ``<item>`` elements)::

    §<tool_call>
    §<invoke name="create_order">§<user_id>42§</user_id>
    §<items>§<item>§<sku>b-1§</sku>§</item>§</items>§</invoke>
    §</tool_call>

An element with children is an object, or an array where the schema says so (repeated
names collect into an array); a leaf is typed from its schema (text without one; an empty
leaf is ``[]`` or ``{}`` where the schema wants an array or object). Text mixed with child
elements is kept under ``$text``. Since a later element can change what an earlier one
means, a call's arguments are sent once its ``</invoke>`` arrives. A call ends the turn:
text after the calls is dropped.
"""

from __future__ import annotations

from typing import Any

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools, dumps
from vllmpy.entrypoints.openai.tool_parsers.xml_args import convert_value, schema_types
from vllmpy.reasoning.abstract import split_at_marker

NS = "]<]minimax[>["
SECTION, SECTION_END = f"{NS}<tool_call>", f"{NS}</tool_call>"
INVOKE, INVOKE_END = f"{NS}<invoke name=", f"{NS}</invoke>"
_MAX_DEPTH = 64
_MIXED_TEXT = "$text"

# an element's value: its text, or its (name, value) children in order
Element = str | list[tuple[str, "Element"]]


def parse_elements(text: str, depth: int = 0) -> tuple[list[tuple[str, Element]], str, str]:
    """The complete elements at the start of ``text``: (the elements, the text between
    them, the text they leave). Stops at a closing tag, or at an element that is cut short
    or malformed."""
    elements: list[tuple[str, Element]] = []
    loose: list[str] = []
    while True:
        at = text.find(NS)
        if at < 0 or text.startswith(NS + "</", at) or depth > _MAX_DEPTH:
            return elements, "".join(loose), text
        element = _parse_element(text[at + len(NS):], depth)
        if element is None:
            return elements, "".join(loose), text
        loose.append(text[:at])
        name, value, text = element
        elements.append((name, value))


def _parse_element(text: str, depth: int) -> tuple[str, Element, str] | None:
    """``<name>body§</name>`` (after its marker) -> (name, value, what follows)."""
    close = text.find(">")
    if not text.startswith("<") or close < 2:
        return None
    name = text[1:close]
    end = f"{NS}</{name}>"
    children, loose, rest = parse_elements(text[close + 1:], depth + 1)
    at = rest.find(end)
    if at < 0:
        return None
    if not children:
        return name, rest[:at], rest[at + len(end):]
    mixed = loose + rest[:at]
    body = children + ([(_MIXED_TEXT, mixed)] if mixed.strip() else [])
    return name, body, rest[at + len(end):]


def _container(schema: dict[str, Any] | None) -> tuple[str, dict[str, Any]] | None:
    """("array" | "object", the schema choice that is one), if the schema allows one."""
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    for kind in ("array", "object"):
        if types == kind or (isinstance(types, list) and kind in types):
            return kind, schema
    if types is None and "items" in schema:
        return "array", schema
    if types is None and "properties" in schema:
        return "object", schema
    for choice in [*schema.get("anyOf", ()), *schema.get("oneOf", ())]:
        found = _container(choice)
        if found is not None:
            return found
    return None


def convert_element(value: Element, schema: dict[str, Any] | None) -> Any:
    container = _container(schema)
    if isinstance(value, str):
        if schema is None:
            return value
        types = schema_types(schema)
        if container is not None and "string" not in types and not value.strip():
            return [] if container[0] == "array" else {}
        return convert_value(types, value)
    if container is not None and container[0] == "array":
        items = container[1].get("items")
        return [convert_element(child, items if isinstance(items, dict) else None)
                for _, child in value]
    return convert_object(value, container[1] if container is not None else None)


def convert_object(elements: list[tuple[str, Element]],
                   schema: dict[str, Any] | None) -> dict[str, Any]:
    properties = (schema or {}).get("properties") or {}
    extra = (schema or {}).get("additionalProperties")
    result: dict[str, Any] = {}
    repeated: set[str] = set()
    for name, element in elements:
        sub = properties.get(name, extra)
        value = convert_element(element, sub if isinstance(sub, dict) else None)
        if name not in result:
            result[name] = value
        elif name in repeated:
            result[name].append(value)
        else:
            result[name] = [result[name], value]
            repeated.add(name)
    return result


class MiniMaxM3ToolParser(ToolParser):
    # the markers are ordinary added tokens: they decode with special tokens skipped

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | section | name | body
        self._name = ""
        self._body = ""

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "section": self._section, "name": self._read_name,
                "body": self._read_body}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        if self.scan_content((SECTION,), final) is None:
            return False
        self._state = "section"
        return True

    def _section(self, final: bool) -> bool:
        """Between calls: the next invoke; the rest (the section's end too) is dropped."""
        _, marker, after = split_at_marker(self._buf, (INVOKE,))
        self._buf = "" if final and marker is None else after
        if marker is not None:
            self._state = "name"
        return marker is not None

    def _read_name(self, final: bool) -> bool:
        at = self._buf.find(">")
        if at < 0:
            if final or len(self._buf) > 512:
                self._buf, self._state = "", "section"
            return final
        name = self._buf[:at].strip().strip("\"'").strip()
        self._buf = self._buf[at + 1:]
        if not name or "<" in name:
            self._state = "section"
            return True
        self.start_call(name)
        self._name, self._body, self._state = name, "", "body"
        return True

    def _read_body(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (INVOKE_END, SECTION_END))
        self._body += before if marker is not None or not final else before + after
        if marker is None and not final:
            self._buf = after
            return False
        function = self.functions.get(self._name) or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        elements, _, _ = parse_elements(self._body)
        self.emit_args(dumps(convert_object(elements, {"properties": properties})))
        self.end_call()
        self._buf = after if marker == INVOKE_END else (marker or "") + after
        self._state = "section"
        return marker is not None
