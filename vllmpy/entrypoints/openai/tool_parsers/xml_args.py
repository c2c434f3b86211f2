"""Arguments written as named text values (the XML-ish formats), typed and streamed.

Many families write a call's arguments as ``name -> text`` pairs between markup
(``<parameter=city>Paris</parameter>``, ``<arg_key>city</arg_key><arg_value>Paris
</arg_value>`` ...). ``ArgsWriter`` turns them into one JSON object on the parser as they
arrive: a value typed as a string streams as it comes (escaped as ``json.dumps`` escapes
it); any other value is collected and written once it ends, converted to the type it
should have. Fed whole or in pieces, the same text is written.

A value's type comes from one of:

- ``"schema"``: the parameter's JSON schema in the request's tool (string types stay text;
  integer / number / boolean parse as such; object and array parse as JSON or a Python
  literal; ``null`` is null); a value that does not parse, and a parameter the schema does
  not name, stay text;
- ``"string"``: the markup says it is a string (DeepSeek's ``string="true"``);
- ``"json"``: the markup says it is JSON (``string="false"``): JSON if it parses, else
  the text;
- an explicit list of type names, converted as the schema's would be.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Sequence
from typing import Any

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, dumps

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum", "any"}


def schema_types(schema: dict[str, Any] | None) -> list[str]:
    """A parameter schema's type names, lower case; no schema is a string."""
    if not isinstance(schema, dict):
        return ["string"]
    kind = schema.get("type", "string" if "enum" in schema else "")
    if not kind:
        choices = [c for key in ("anyOf", "oneOf") for c in schema.get(key) or ()
                   if isinstance(c, dict)]
        if choices:
            return [k for c in choices for k in schema_types(c)]
    kinds = kind if isinstance(kind, list) else [kind]
    return [str(k).lower() for k in kinds]


def is_string_type(types: Sequence[str]) -> bool:
    return any(k in _STRING_TYPES for k in types)


def convert_value(types: Sequence[str], value: str) -> Any:
    """``value`` as the first of ``types`` that takes it; the text itself otherwise."""
    if value.strip().lower() == "null":
        return None
    for kind in types:
        text = value.strip()
        try:
            if kind.startswith("int") or kind in ("uint", "long", "short", "unsigned"):
                return int(text)
            if kind.startswith("num") or kind.startswith("float") or kind == "double":
                number = json.loads(text)
                if isinstance(number, (int, float)) and not isinstance(number, bool):
                    return number
            elif kind in ("boolean", "bool", "binary") and text.lower() in ("true", "false"):
                return text.lower() == "true"
            elif kind in ("object", "array", "dict", "list", "arr", "map") or not kind:
                return json_or_literal(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


def json_or_literal(text: str) -> Any:
    """JSON, or else a Python literal JSON can hold; raises ValueError / SyntaxError."""
    try:
        return json.loads(text)
    except ValueError:
        value = ast.literal_eval(text)
        json.dumps(value)  # refuses what JSON cannot hold (a ValueError or TypeError)
        return value


class ArgsWriter:
    """One call's arguments object, written on ``parser`` parameter by parameter.

    ``begin(key, kind)`` opens a value, ``add(text)`` feeds its text (any number of
    times), ``end()`` closes it, ``put(key, value)`` writes a whole value at once, and
    ``finish()`` closes the object (``{}`` when it had no parameter). With ``strip``,
    whitespace around a value is not part of it.
    """

    def __init__(self, parser: ToolParser, function: str, strip: bool = False) -> None:
        self.parser = parser
        self.strip = strip
        spec = parser.functions.get(function) or {}
        self.properties = (spec.get("parameters") or {}).get("properties") or {}
        self.count = 0
        self.open = False  # a value is being read
        self._string = False
        self._types: Sequence[str] = ()
        self._value = ""  # a non-string value, collected
        self._started = False  # a stripped string has had its first non-space
        self._held = ""  # trailing whitespace of a stripped string, held back

    def types_of(self, key: str) -> list[str]:
        schema = self.properties.get(key)
        return schema_types(schema if isinstance(schema, dict) else None)

    def begin(self, key: str, kind: str | Sequence[str] = "schema") -> None:
        if self.open:
            self.end()
        if kind == "schema":
            types: Sequence[str] = self.types_of(key)
        elif kind == "string":
            types = ["string"]
        elif kind == "json":
            types = ["json"]
        else:
            types = list(kind)
        self._string = is_string_type(types)
        self._types, self._value, self._started, self._held = types, "", False, ""
        self._key(key)
        if self._string:
            self.parser.emit_args('"')
        self.open = True

    def add(self, text: str) -> None:
        if not self._string:
            self._value += text
            return
        if self.strip:
            if not self._started:
                text = text.lstrip()
                self._started = bool(text)
            text = self._held + text
            body = text.rstrip()
            self._held, text = text[len(body):], body
        if text:
            self.parser.emit_args(json.dumps(text, ensure_ascii=False)[1:-1])

    def end(self) -> None:
        if not self.open:
            return
        self.open = False
        if self._string:
            self.parser.emit_args('"')
            return
        value = self._value.strip() if self.strip else self._value
        if list(self._types) == ["json"]:
            try:
                converted: Any = json.loads(value)
            except ValueError:
                converted = value
        else:
            converted = convert_value(self._types, value)
        self.parser.emit_args(dumps(converted))

    def put(self, key: str, value: Any) -> None:
        if self.open:
            self.end()
        self._key(key)
        self.parser.emit_args(dumps(value))

    def finish(self) -> None:
        self.end()
        self.parser.emit_args("}" if self.count else "{}")

    def _key(self, key: str) -> None:
        self.parser.emit_args(("{" if self.count == 0 else ", ") + dumps(key) + ": ")
        self.count += 1
