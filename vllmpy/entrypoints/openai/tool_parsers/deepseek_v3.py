"""deepseek_v3: DeepSeek-V3 / R1 calls between its full-width markers::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1's shorter form, ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":
"Paris"}<｜tool▁call▁end｜>`` (no type, no code fence), is read too. Text before the calls
and after ``<｜tool▁calls▁end｜>`` is content; text between calls is dropped.

deepseek_v31 reads the V3.1 form only: there a call's first field is always the function's
name, even a function named ``function``.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.json_stream import JsonValueWriter
from vllmpy.reasoning.abstract import split_at_marker

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3ToolParser(ToolParser):
    needs_special_tokens = True  # the markers are special tokens in some of its vocabularies
    v3_form = True  # "function<｜tool▁sep｜>name" followed by a fenced JSON block

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | section | head | name | fence | args | tail
        self._writer: JsonValueWriter | None = None

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "section": self._section, "head": self._head,
                "name": self._name, "fence": self._fence, "args": self._args,
                "tail": self._tail}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        marker = self.scan_content((CALLS_BEGIN, CALL_BEGIN), final)
        if marker is None:
            return False
        self._state = "section" if marker == CALLS_BEGIN else "head"
        return True

    def _section(self, final: bool) -> bool:
        """Between calls: the next call, or the end of the calls; the rest is dropped."""
        _, marker, after = split_at_marker(self._buf, (CALL_BEGIN, CALLS_END))
        self._buf = after
        if marker is None:
            if final:
                self._buf = ""
            return False
        self._state = "head" if marker == CALL_BEGIN else "text"
        return True

    def _head(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (SEP, CALL_END))
        if marker is None:
            if final:
                self._buf = ""
            return False
        self._buf = after
        if marker == CALL_END or not before.strip():
            self._state = "section"  # a call with no name is dropped
        elif self.v3_form and before.strip() == "function":
            self._state = "name"  # V3: the name follows on its own line
        else:
            self._open(before.strip())
        return True

    def _name(self, final: bool) -> bool:
        """V3: the name is the rest of the line after ``function<｜tool▁sep｜>``."""
        line, newline, after = self._buf.partition("\n")
        before, marker, _ = split_at_marker(line, (CALL_END,))
        if not newline and marker is None and not final:
            return False
        name = before.strip()
        if not name:
            self._state = "section"  # a call with no name is dropped
            return True
        if marker is not None:  # the call ends on the name's line: no arguments
            self._buf = line[len(before):] + newline + after
            self._open(name)
            self._state = "tail"
            return True
        self._buf = after
        self._open(name, fenced=True)
        return True

    def _open(self, name: str, fenced: bool = False) -> None:
        self.start_call(name)
        self._writer = JsonValueWriter()
        self._state = "fence" if fenced else "args"

    def _fence(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(FENCE):
            self._buf = stripped[len(FENCE):]
        elif not final and (not stripped or FENCE.startswith(stripped)):
            return False
        self._state = "args"
        return True

    def _args(self, final: bool) -> bool:
        writer = self._writer
        assert writer is not None
        if not self.feed_args(writer, final):
            return False
        self._state = "tail"
        return True

    def _tail(self, final: bool) -> bool:
        """After the arguments: the closing fence and the call's end marker."""
        _, marker, after = split_at_marker(self._buf, (CALL_END, CALL_BEGIN, CALLS_END))
        if marker is None and not final:
            self._buf = after  # the closing fence is dropped; a marker's start is kept
            return False
        writer = self._writer
        if writer is not None and not writer.done:
            self.emit_args(writer.close() if writer.started else "{}")
        self._writer = None
        self.end_call()
        if marker == CALL_END:
            self._buf = after
            self._state = "section"
        elif marker is not None:
            self._buf = marker + after
            self._state = "section"
        else:
            self._buf = ""
        return marker is not None


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    v3_form = False
