"""mistral: Mistral's calls follow the ``[TOOL_CALLS]`` token, in either of its two forms::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

The first is the older tokenizers' (up to v7), the second v11 and later's; a
``[CALL_ID]<id>`` between the name and ``[ARGS]`` gives the call its id. Text before
``[TOOL_CALLS]`` is content. Call ids are Mistral's 9 letters and digits.
"""

from __future__ import annotations

import re

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools, mistral_call_id
from vllmpy.entrypoints.openai.tool_parsers.json_stream import CallArrayReader, JsonValueWriter
from vllmpy.reasoning.abstract import split_at_marker

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")


class MistralToolParser(ToolParser):
    needs_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | marker | array | name | args
        self._raw = ""  # text read since [TOOL_CALLS], given back if it is no call
        self._array: CallArrayReader | None = None
        self._writer: JsonValueWriter | None = None
        self._next_id: str | None = None

    def make_id(self) -> str:
        given, self._next_id = self._next_id, None
        return given or mistral_call_id()

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "marker": self._marker, "array": self._read_array,
                "name": self._name, "args": self._args}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        if self.scan_content((TOOL_CALLS,), final) is None:
            return False
        self._state, self._raw = "marker", ""
        return True

    def _marker(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not stripped and not final:
            return False
        self._raw = self._buf[:len(self._buf) - len(stripped)]
        self._buf = stripped
        if stripped.startswith("["):
            self._state, self._array = "array", CallArrayReader(self)
        else:
            self._state = "name"
        return True

    def _give_back(self) -> bool:
        self.emit_content(TOOL_CALLS + self._raw)
        self._state = "text"
        return True

    def _read_array(self, final: bool) -> bool:
        reader = self._array
        assert reader is not None
        used = reader.feed(self._buf, final)
        self._raw += self._buf[:used]
        self._buf = self._buf[used:]
        if reader.done:
            self._state = "text"
            return True
        if reader.error is None and not final:
            return False
        if reader.close():
            self._state = "text"
            return True
        return self._give_back()

    def _name(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (ARGS, CALL_ID))
        if marker is None:
            if final or len(before) > 256:
                self._buf = before + after
                return self._give_back()
            return False
        name = before.strip()
        if not _NAME.fullmatch(name):
            return self._give_back()
        if marker == CALL_ID:
            call_id, id_marker, rest = split_at_marker(after, (ARGS,))
            if id_marker is None:
                if final:
                    return self._give_back()
                return False
            self._next_id, after = call_id.strip() or None, rest
        self._buf = after
        self.start_call(name)
        self._state, self._writer = "args", JsonValueWriter()
        return True

    def _args(self, final: bool) -> bool:
        writer = self._writer
        assert writer is not None
        if not self.feed_args(writer, final):
            return False
        if not writer.done:
            self.emit_args(writer.close() if writer.started else "{}")
        self.end_call()
        self._state = "text"
        return True
