"""The output forms of ``tool_choice`` "required" and a named function.

Both are enforced with structured output (vLLM's schemas): "required" makes the model
write a JSON array of ``{"name": ..., "parameters": {...}}`` objects (at least one, each
naming a request tool), a named function makes it write that function's arguments object
itself. These parsers read those forms back into calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.json_stream import JsonValueWriter
from vllmpy.entrypoints.openai.tool_parsers.leading import LeadingJsonToolParser

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or dict(_EMPTY_PARAMETERS)


def required_schema(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """An array (minItems 1) of {name, parameters} objects, one shape per tool."""
    shapes: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for tool in tools:
        function = tool["function"]
        parameters = _parameters(function)
        defs.update(parameters.get("$defs") or {})
        shapes.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                      "parameters": parameters},
                       "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": shapes}}
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The named function's parameters schema (an empty object schema when it has none)."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return _parameters(tool["function"])
    raise ValueError(f"no tool named {name!r}")


class RequiredToolParser(LeadingJsonToolParser):
    opener = "["
    args_keys = ("parameters", "arguments")


class NamedToolParser(ToolParser):
    """The whole output is the named function's arguments; the call opens with its first
    character. Output that is not JSON from the start is content."""

    def __init__(self, tools: Tools = None, *, name: str) -> None:
        super().__init__(tools)
        self.name = name
        self._writer: JsonValueWriter | None = JsonValueWriter()

    def _parse(self, final: bool) -> None:
        writer = self._writer
        if writer is None:  # after the arguments: content
            self.emit_content(self._buf)
            self._buf = ""
            return
        used, written = writer.feed(self._buf, final)
        if writer.started and not self.in_call and self.num_calls == 0:
            self.start_call(self.name)
        self.emit_args(written)
        self._buf = self._buf[used:]
        if writer.done or writer.error is not None or final:
            if self.in_call:
                self.emit_args(writer.close())
                self.end_call()
            self._writer = None
            self._parse(final)
