"""hermes: Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as a JSON object between tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content. A missing ``</tool_call>`` is tolerated (the object's end
ends the call), and so is junk between the object and the end tag. A tag whose body is not
a call object is given back as content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.json_stream import CallArrayReader, CallObjectReader
from vllmpy.reasoning.abstract import split_at_marker


class TaggedJsonToolParser(ToolParser):
    """Calls as JSON objects (or one JSON array of them, with ``array``) between a start
    and an (optional) end marker."""

    start = "<tool_call>"
    end = "</tool_call>"
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    array = False

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | call | after
        self._reader: CallObjectReader | CallArrayReader | None = None
        self._raw = ""  # the body read so far, given back if it turns out not to be a call

    def _parse(self, final: bool) -> None:
        progressing = True
        while progressing:
            if self._state == "text":
                progressing = self.scan_content((self.start,), final) is not None
                if progressing:
                    self._state, self._raw = "call", ""
                    reader = CallArrayReader if self.array else CallObjectReader
                    self._reader = reader(self, self.args_keys)
            elif self._state == "call":
                progressing = self._read_call(final)
            else:
                progressing = self._after_call(final)

    def _read_call(self, final: bool) -> bool:
        reader = self._reader
        assert reader is not None
        if reader.error is None:
            used = reader.feed(self._buf, final)
            self._raw += self._buf[:used]
            self._buf = self._buf[used:]
            if reader.done:
                self._state = "after"
                return True
            if reader.error is None and not final:
                return False
        # the body ended, or stopped being JSON at self._buf[0]
        if not final and len(self._buf) < len(self.end) and self.end.startswith(self._buf):
            return False  # perhaps the end marker: wait for it
        if reader.close():
            self._state = "after"  # an opened call is finished; skip to the end marker
        else:  # not a call after all: the tag and its body are content
            self.emit_content(self.start)
            self._buf = self._raw + self._buf
            self._state, self._reader = "text", None
        return True

    def _after_call(self, final: bool) -> bool:
        """Text after a call object, up to the end marker, is dropped; without an end
        marker before the next call (or the end), it is content."""
        before, marker, after = split_at_marker(self._buf, (self.end, self.start))
        if marker == self.end:
            self._buf = after
        elif marker is None and not final:
            return False
        elif marker is None and self.end.startswith(self._buf.strip()):
            self._buf = ""  # the end marker, cut short
        self._state, self._reader = "text", None
        return True


class HermesToolParser(TaggedJsonToolParser):
    needs_special_tokens = True  # the tags are special tokens in Hermes 2 Pro's vocabulary
