"""inkling: Inkling writes typed blocks, every marker a special token::

    <|message_model|><|content_thinking|>I should look it up.<|end_message|>
    <|message_model|><|content_text|>Let me check.<|end_message|>
    <|message_model|><|content_invoke_tool_json|>{"name": "get_weather", "args": {"city": "Paris"}}<|end_message|>

The prompt opens the first message, so the output starts inside a message header: text
there (an optional function name) is metadata, dropped once a block opens, and content
when the message ends without one. Text blocks, and the raw-tool and tool-error blocks,
are content; a thinking block is reasoning, not content, and is dropped here; a tool
block is one JSON call whose arguments are under ``args`` (or ``arguments``). A block may
also end with ``<|content_model_end_sampling|>``.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.json_stream import CallObjectReader
from vllmpy.reasoning.abstract import split_at_marker

MESSAGE = "<|message_model|>"
TEXT, THINKING = "<|content_text|>", "<|content_thinking|>"
TOOL_JSON, TOOL_TEXT = "<|content_invoke_tool_json|>", "<|content_invoke_tool_text|>"
TOOL_ERROR = "<|content_tool_error|>"
END, END_SAMPLING = "<|end_message|>", "<|content_model_end_sampling|>"
_MARKERS = (MESSAGE, TEXT, THINKING, TOOL_JSON, TOOL_TEXT, TOOL_ERROR, END, END_SAMPLING)
_ARGS_KEYS = ("args", "arguments", "parameters")


class InklingEngineToolParser(ToolParser):
    needs_special_tokens = True  # the whole grammar is special tokens

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "header"  # header | content | thinking | tool | tool_end
        self._header = ""  # header text, content only if its message ends without a block
        self._reader: CallObjectReader | None = None
        self._raw = ""

    def _parse(self, final: bool) -> None:
        step = {"header": self._read_header, "content": self._content,
                "thinking": self._thinking, "tool": self._tool, "tool_end": self._tool_end}
        while step[self._state](final):
            pass

    def _open(self, marker: str) -> None:
        """Enter what ``marker`` opens."""
        if marker == MESSAGE:
            self._state, self._header = "header", ""
        elif marker == THINKING:
            self._state = "thinking"
        elif marker == TOOL_JSON:
            self._state, self._raw = "tool", TOOL_JSON
            self._reader = CallObjectReader(self, _ARGS_KEYS)
        else:  # a text block, a raw-tool or error block, or the end of one
            self._state = "content"

    def _read_header(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, _MARKERS)
        self._header += before
        self._buf = after if marker is not None or not final else ""
        if marker is None:
            if final:
                self.emit_content(self._header + after)
            return False
        if marker in (END, END_SAMPLING):
            self.emit_content(self._header)
        self._header = ""
        self._open(marker)
        return True

    def _content(self, final: bool) -> bool:
        marker = self.scan_content(_MARKERS, final)
        if marker is None:
            return False
        self._open(marker)
        return True

    def _thinking(self, final: bool) -> bool:
        _, marker, after = split_at_marker(self._buf, (END, END_SAMPLING, TOOL_JSON, MESSAGE))
        self._buf = after if marker is not None or not final else ""
        if marker is None:
            return False
        self._open(marker)
        self._strip_ws = True
        return True

    def _tool(self, final: bool) -> bool:
        reader = self._reader
        assert reader is not None
        used = reader.feed(self._buf, final)
        self._raw += self._buf[:used]
        self._buf = self._buf[used:]
        if not reader.done and reader.error is None and not final:
            return False
        if reader.done or reader.close():
            self._state = "tool_end"
        else:  # not a call: the block is content
            self.emit_content(self._raw)
            self._state = "content"
        return True

    def _tool_end(self, final: bool) -> bool:
        """After the call object, up to the block's end; what is between is dropped."""
        _, marker, after = split_at_marker(self._buf, (END, END_SAMPLING, MESSAGE))
        self._buf = after if marker is not None or not final else ""
        if marker is None:
            return False
        self._open(marker)
        return True
