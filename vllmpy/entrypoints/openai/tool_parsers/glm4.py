"""glm45, glm47, ling3: GLM-4.5 / 4.6 / 4.7 (and inclusionAI's Ling 3, which writes the
same) put the function's name after ``<tool_call>`` and each argument as a key / value
pair::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7 leaves the newlines out (``<tool_call>get_weather<arg_key>city</arg_key>...``);
both are read. The chat templates write a string value as it is and any other value as
JSON, so values are typed from the tool schema; a string keeps its whitespace. Text outside
the calls is content.

``KeyValueToolParser`` reads this shape of call for any spelling of its markers
(Hunyuan's, K2 Horizon's): an optional section around the calls, the name up to the first
argument (or a separator), an optional type tag between a key and its value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.xml_args import ArgsWriter
from vllmpy.reasoning.abstract import split_at_marker

_MAX_NAME = 256  # a name longer than this without its end is not markup


class KeyValueToolParser(ToolParser):
    """Key / value calls; a family sets the markers below (see the module doc)."""

    section_start = ""  # opens the calls, where the family has a section ("" if none)
    section_end = ""
    call_start, call_end = "<tool_call>", "</tool_call>"
    name_ends: tuple[str, ...] = ("\n",)  # what ends a name besides the first argument
    key_start, key_end = "<arg_key>", "</arg_key>"
    type_start, type_end = "", ""  # an argument's type tag, where the family has one
    value_start, value_end = "<arg_value>", "</arg_value>"
    drop_after_section = False  # text after the section is dropped, not content

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        # text | section | name | params | key | ktail | type | value (+ a family's own)
        self._state = "text"
        self._in_section = False
        self._args: ArgsWriter | None = None
        self._key = ""
        self._type = ""

    def value_kind(self, key: str, type_tag: str) -> str | Sequence[str]:
        """How a value is typed (see ``xml_args``), given the type tag written before it."""
        return "schema"

    def steps(self) -> dict[str, Callable[[bool], bool]]:
        return {"text": self._text, "section": self._section, "name": self._name,
                "params": self._params, "key": self._read_key, "ktail": self._key_tail,
                "type": self._read_type, "value": self._value}

    def _parse(self, final: bool) -> None:
        steps = self.steps()
        while steps[self._state](final):
            pass

    def open_call(self, name: str) -> None:
        """Start the call; a family whose body is not key / value pairs overrides it."""
        self.start_call(name)
        self._args = ArgsWriter(self, name)

    def _text(self, final: bool) -> bool:
        start = self.section_start or self.call_start
        if self.scan_content((start,), final) is None:
            return False
        self._in_section = bool(self.section_start)
        self._state = "section" if self.section_start else "name"
        return True

    def _section(self, final: bool) -> bool:
        """Between calls: the next call or the end of the section; the rest is dropped."""
        _, marker, after = split_at_marker(self._buf, (self.call_start, self.section_end))
        self._buf = "" if final and marker is None else after
        if marker == self.call_start:
            self._state = "name"
        elif marker is not None and not self.drop_after_section:
            self._in_section, self._state = False, "text"
        return marker is not None

    def _name(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not stripped and not final:
            return False
        ends = (self.key_start, self.call_end, *self.name_ends)
        before, marker, after = split_at_marker(stripped, ends)
        if marker is None and not final and len(before) <= _MAX_NAME:
            return False
        name = (before + after if marker is None else before).strip()
        if not name or len(name) > _MAX_NAME or "<" in name or len(name.split()) > 1:
            return self._not_a_call()  # a name is one word
        self.open_call(name)
        self._buf = after if marker is not None else ""
        if marker is None or marker == self.call_end:
            self._finish()
        else:
            self._state = "key" if marker == self.key_start else "params"
        return True

    def _not_a_call(self) -> bool:
        """A call whose name is not one: content outside a section, else dropped."""
        if not self._in_section:
            self.emit_content(self.call_start)
        self._state = "section" if self._in_section else "text"
        return True

    def _params(self, final: bool) -> bool:
        _, marker, after = split_at_marker(self._buf, (self.key_start, self.call_end))
        self._buf = "" if final and marker is None else after
        if marker == self.key_start:
            self._state = "key"
        elif marker is not None or final:
            self._finish()
        return marker is not None

    def _read_key(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (self.key_end, self.call_end))
        if marker is None:
            if final:  # cut short inside a key: the call ends without it
                self._buf = ""
                self._finish()
            return False
        self._buf = after
        if marker == self.call_end:
            self._finish()
            return True
        self._key, self._type = before.strip(), ""
        self._state = "ktail"
        return True

    def _key_tail(self, final: bool) -> bool:
        """After a key: its value (a type tag first, where the family has them)."""
        stripped = self._buf.lstrip()
        starts = (self.value_start, *((self.type_start,) if self.type_start else ()))
        if not final and any(s.startswith(stripped) for s in starts):
            return False
        if stripped.startswith(self.value_start):
            self._buf = stripped[len(self.value_start):]
            assert self._args is not None
            self._args.begin(self._key, self.value_kind(self._key, self._type))
            self._state = "value"
        elif self.type_start and stripped.startswith(self.type_start):
            self._buf = stripped[len(self.type_start):]
            self._state = "type"
        else:  # a key without a value is dropped
            self._state = "params"
        return True

    def _read_type(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (self.type_end, self.call_end))
        if marker is None and not final:
            return False
        self._type = before.strip()
        self._buf = after if marker == self.type_end else (marker or "") + after
        self._state = "ktail" if marker == self.type_end else "params"
        return True

    def _value(self, final: bool) -> bool:
        assert self._args is not None
        markers = (self.value_end, self.call_end, self.key_start)
        before, marker, after = split_at_marker(self._buf, markers)
        if marker is None and not final:
            self._args.add(before)
            self._buf = after
            return False
        self._args.add(before if marker is not None else before + after)
        self._args.end()
        self._buf = after if marker == self.value_end else (marker or "") + after
        self._state = "params"
        return True

    def _finish(self) -> None:
        """The call ends (its end marker, or the end of the text)."""
        if self._args is not None:
            self._args.finish()
            self._args = None
        self.end_call()
        self._state = "section" if self._in_section else "text"


class Glm4ToolParser(KeyValueToolParser):
    needs_special_tokens = True  # <tool_call> and the argument tags are special tokens
