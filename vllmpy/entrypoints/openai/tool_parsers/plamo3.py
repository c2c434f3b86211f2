"""plamo3: PLaMo 3 writes its calls as marked requests, each a name and a JSON arguments
object::

    <|plamo:begin_tool_requests:plamo|><|plamo:begin_tool_request:plamo|>
    <|plamo:begin_tool_name:plamo|>get_weather<|plamo:end_tool_name:plamo|>
    <|plamo:begin_tool_arguments:plamo|><|plamo:constrain|>json<|plamo:msg|>{"city": "Paris"}
    <|plamo:end_tool_arguments:plamo|><|plamo:end_tool_request:plamo|>
    <|plamo:end_tool_requests:plamo|>

(on one line as the model writes it). The arguments stream as they arrive. Text before and
after the requests is content; the end-of-turn marker ``<|plamo:tag|>`` is not.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.json_stream import JsonValueWriter
from vllmpy.reasoning.abstract import split_at_marker

REQUESTS, REQUESTS_END = "<|plamo:begin_tool_requests:plamo|>", "<|plamo:end_tool_requests:plamo|>"
REQUEST, REQUEST_END = "<|plamo:begin_tool_request:plamo|>", "<|plamo:end_tool_request:plamo|>"
NAME, NAME_END = "<|plamo:begin_tool_name:plamo|>", "<|plamo:end_tool_name:plamo|>"
ARGS, ARGS_END = "<|plamo:begin_tool_arguments:plamo|>", "<|plamo:end_tool_arguments:plamo|>"
CONSTRAIN = "<|plamo:constrain|>json<|plamo:msg|>"
EOT = "<|plamo:tag|>"


class Plamo3EngineToolParser(ToolParser):
    needs_special_tokens = True  # the markers are made of special tokens

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | section | name | request | constrain | args
        self._writer: JsonValueWriter | None = None

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "section": self._section, "name": self._name,
                "request": self._request, "constrain": self._constrain, "args": self._args}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        marker = self.scan_content((REQUESTS, REQUEST, EOT), final)
        if marker is None:
            return False
        if marker != EOT:
            self._state = "section"
        return True

    def _section(self, final: bool) -> bool:
        """Between requests: the next name, or the end of the requests; the rest is dropped."""
        _, marker, after = split_at_marker(self._buf, (NAME, REQUESTS_END, EOT))
        self._buf = after if marker is not None or not final else ""
        if marker is None:
            return False
        self._state = "name" if marker == NAME else "text"
        return True

    def _name(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (NAME_END,))
        if marker is None and not final:
            return False
        self._buf = after
        if before.strip():
            self.start_call(before.strip())
            self._state = "request"
        else:
            self._state = "section"  # a request with no name is dropped
        return True

    def _request(self, final: bool) -> bool:
        """After the name: its arguments, or the request's end."""
        _, marker, after = split_at_marker(self._buf, (ARGS, REQUEST_END, REQUESTS_END, EOT))
        self._buf = after if marker is not None or not final else ""
        if marker is None and not final:
            return False
        if marker == ARGS:
            self._state, self._writer = "constrain", JsonValueWriter()
            return True
        self._close_call()
        self._state = "text" if marker in (REQUESTS_END, EOT) else "section"
        return marker is not None

    def _constrain(self, final: bool) -> bool:
        if self._buf.startswith(CONSTRAIN):
            self._buf = self._buf[len(CONSTRAIN):]
        elif not final and CONSTRAIN.startswith(self._buf):
            return False
        self._state = "args"
        return True

    def _args(self, final: bool) -> bool:
        writer = self._writer
        assert writer is not None
        if not self.feed_args(writer, final):
            return False
        self._state = "request"
        return True

    def _close_call(self) -> None:
        writer = self._writer
        if writer is None or not writer.started:
            self.emit_args("{}")
        elif not writer.done:
            self.emit_args(writer.close())
        self._writer = None
        self.end_call()
