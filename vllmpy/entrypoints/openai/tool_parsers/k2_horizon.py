"""k2_horizon: K2 Horizon's IFM calls, inside an ``<ifm|tool_calls>`` section, in any of
the three forms its chat template can be asked for (``tool_call_format``)::

    xml:        <ifm|tool_call>get_weather<ifm|arg_key>city</ifm|arg_key>
                <ifm|arg_value>Paris</ifm|arg_value></ifm|tool_call>
    xml_typed:  ... <ifm|arg_key>days</ifm|arg_key><ifm|arg_type>integer</ifm|arg_type>
                <ifm|arg_value>3</ifm|arg_value> ...
    json:       <ifm|tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}
                </ifm|tool_call>

Each call's form is read from the call itself, so the three need no request option. An
XML value is typed from the tool schema; an ``arg_type`` narrows a schema of several types
to the one named, and types a parameter the schema does not name (``any`` is text). Text
before and after the section is content.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllmpy.entrypoints.openai.tool_parsers.glm4 import KeyValueToolParser
from vllmpy.entrypoints.openai.tool_parsers.json_stream import CallObjectReader


class K2HorizonToolParser(KeyValueToolParser):
    needs_special_tokens = True  # the IFM markers are special tokens
    section_start, section_end = "<ifm|tool_calls>", "</ifm|tool_calls>"
    call_start, call_end = "<ifm|tool_call>", "</ifm|tool_call>"
    name_ends = ()
    key_start, key_end = "<ifm|arg_key>", "</ifm|arg_key>"
    type_start, type_end = "<ifm|arg_type>", "</ifm|arg_type>"
    value_start, value_end = "<ifm|arg_value>", "</ifm|arg_value>"

    _reader: CallObjectReader | None = None

    def steps(self) -> dict[str, Callable[[bool], bool]]:
        return {**super().steps(), "json": self._json}

    def value_kind(self, key: str, type_tag: str) -> str | Sequence[str]:
        written = type_tag.split("[", 1)[0].strip().lower()  # "array[string]" -> "array"
        if not written:
            return "schema"
        assert self._args is not None
        types = self._args.types_of(key)
        if key not in self._args.properties:
            return [written]
        return [written] if written in types else types

    def _name(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not stripped.startswith("{"):
            return super()._name(final)
        self._buf = stripped
        self._reader = CallObjectReader(self)
        self._state = "json"
        return True

    def _json(self, final: bool) -> bool:
        reader = self._reader
        assert reader is not None
        used = reader.feed(self._buf, final)
        self._buf = self._buf[used:]
        if not reader.done and reader.error is None and not final:
            return False
        if not reader.done:
            reader.close()  # an opened call is finished; one without a name is dropped
        self._reader = None
        self._state = "params"  # up to the call's end marker, the rest is dropped
        return True
