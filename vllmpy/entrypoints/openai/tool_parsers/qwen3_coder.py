"""qwen3_coder: Qwen3-Coder's XML calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value loses one leading and one trailing newline and is converted by the
type its tool schema gives it: string types stay text (and stream as they arrive),
integer / number / boolean parse as such, object and array parse as JSON (or a Python
literal), ``null`` is null; a value that does not parse, and a parameter the schema does
not name, stay text. ``<tool_call>`` may be left out around ``<function=...>``; a missing
``</parameter>`` before the next parameter or ``</function>`` is tolerated.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.xml_args import ArgsWriter
from vllmpy.reasoning.abstract import split_at_marker

FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_MAX_NAME = 256  # a name longer than this without its '>' is not markup


class Qwen3CoderToolParser(ToolParser):
    needs_special_tokens = True  # <tool_call> is a special token in Qwen3's vocabulary
    call_start, call_end = "<tool_call>", "</tool_call>"
    trim_newlines = True  # a value loses one leading and one trailing newline

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        # text | open | name | params | pname | pvalue | after
        self._state = "text"
        self._marker = ""  # the markup read since the call began, given back if no call
        self._args: ArgsWriter | None = None
        self._value_begun = False  # the value's optional leading newline was dealt with

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "open": self._open, "name": self._name,
                "params": self._params_step, "pname": self._pname, "pvalue": self._pvalue,
                "after": self._after}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        marker = self.scan_content((self.call_start, FUNC), final)
        if marker is None:
            return False
        self._marker = marker
        self._state = "open" if marker == self.call_start else "name"
        return True

    def _open(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(FUNC):
            self._marker += self._buf[:len(self._buf) - len(stripped)] + FUNC
            self._buf = stripped[len(FUNC):]
            self._state = "name"
            return True
        if not final and FUNC.startswith(stripped):
            return False
        return self._give_back()

    def _give_back(self) -> bool:
        """What began like a call is not one: its markup is content."""
        self.emit_content(self._marker)
        self._state = "text"
        return True

    def _read_name(self, final: bool) -> str | None:
        at = self._buf.find(">")
        if at < 0:
            if final or len(self._buf) > _MAX_NAME:
                self._give_back()
            return None
        name = self._buf[:at].strip()
        if not name or len(name) > _MAX_NAME or "<" in name or "\n" in name:
            self._give_back()
            return None
        self._buf = self._buf[at + 1:]
        return name

    def _name(self, final: bool) -> bool:
        name = self._read_name(final)
        if name is None:
            return self._state == "text"  # given back as content, or waiting for '>'
        self.start_call(name)
        self._args = ArgsWriter(self, name)
        self._state = "params"
        return True

    def _params_step(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (PARAM, FUNC_END, self.call_end))
        if marker is None:
            # text between parameters is not part of the call; at the end, neither is a
            # marker cut short
            self._buf = "" if final else after
            if final:
                self._end_function()
                self._state = "text"
            return final
        self._buf = after
        if marker == PARAM:
            self._state = "pname"
        else:
            self._end_function()
            self._state = "after" if marker == FUNC_END else "text"
        return True

    def _pname(self, final: bool) -> bool:
        at = self._buf.find(">")
        if at < 0:
            if final:  # cut short inside a parameter's name: the call ends without it
                self._buf = ""
                self._end_function()
                self._state = "text"
            return final
        assert self._args is not None
        self._args.begin(self._buf[:at].strip())
        self._buf = self._buf[at + 1:]
        self._value_begun = False
        self._state = "pvalue"
        return True

    def _pvalue(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (PARAM_END, PARAM, FUNC_END))
        ended = marker is not None or final
        if marker is None and final:
            before, after = before + after, ""
        if not self._value_begun:
            if not before and not ended:
                return False  # the first character decides on the leading newline
            if self.trim_newlines:
                before = before.removeprefix("\n")
            self._value_begun = True
        if not ended:
            # keep a trailing newline back: it may be the one that ends the value
            hold = 1 if before.endswith("\n") and self.trim_newlines else 0
            self._add_value(before[:len(before) - hold])
            self._buf = before[len(before) - hold:] + after
            return False
        if self.trim_newlines:
            before = before.removesuffix("\n")
        self._add_value(before)
        assert self._args is not None
        self._args.end()
        self._buf = after if marker == PARAM_END else (marker or "") + after
        self._state = "params"
        return True

    def _add_value(self, text: str) -> None:
        assert self._args is not None
        self._args.add(text)

    def _end_function(self) -> None:
        assert self._args is not None
        self._args.finish()
        self.end_call()

    def _after(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (self.call_end, self.call_start, FUNC))
        if marker == self.call_end:
            self._buf = after
        elif marker is None and not final:
            return False
        self._state = "text"
        return True
