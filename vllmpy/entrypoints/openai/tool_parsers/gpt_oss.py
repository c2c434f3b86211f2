"""openai: gpt-oss writes harmony messages, each addressed by a channel and a recipient::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A message to ``functions.NAME`` (the recipient may also come before the channel, and
``functions.`` may be left out) is a call of NAME: its JSON body streams as the arguments;
a body in another content type (``<|constrain|>`` or a word after the channel) is sent as
one JSON string. ``final`` messages, and ``commentary`` ones with no recipient (preambles),
are content. ``analysis`` is reasoning, not content, and is dropped here, and so are
messages to the built-in tools (``browser``, ``python``, ``container``).
"""

from __future__ import annotations

import re

from vllmpy.entrypoints.openai.tool_parsers.abstract import Tools, dumps
from vllmpy.entrypoints.openai.tool_parsers.channel_messages import (
    ChannelMessagesParser,
    Route,
)
from vllmpy.entrypoints.openai.tool_parsers.json_stream import JsonValueWriter

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)(?:\s+([^\s<]+))?")
_CONSTRAIN = re.compile(r"<\|constrain\|>\s*([^\s<]+)")
_BUILTIN = {"browser", "python", "container"}


def _function(recipient: str | None) -> str | None:
    """The function a recipient names, or None (a built-in tool, the assistant)."""
    if not recipient or recipient.startswith("<|") or recipient == "assistant":
        return None
    if recipient.startswith("functions."):
        return recipient[len("functions."):] or None
    return None if recipient.split(".", 1)[0] in _BUILTIN else recipient


class GptOssToolParser(ChannelMessagesParser):
    needs_special_tokens = True  # the harmony markers are special tokens
    ends = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._writer: JsonValueWriter | None = None
        self._text = ""  # a text-typed call body

    def _parse(self, final: bool) -> None:
        step = {**self.channel_states(), "call": self._call}
        while step[self._state](final):
            pass

    def route(self, header: str) -> Route:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = _function(recipient.group(1) if recipient else None)
        if name is not None:
            constrain = _CONSTRAIN.search(header)
            ctype = constrain.group(1) if constrain else (channel.group(2) if channel else None)
            if ctype is not None and ctype.startswith("to="):
                ctype = None
            return Route("call", name, ctype is None or "json" in ctype)
        kind = channel.group(1) if channel else None
        if kind == "final" or (kind == "commentary" and recipient is None):
            return Route("content")
        return Route("drop")

    def begin_call(self, route: Route) -> None:
        self.start_call(route.name)
        self._writer = JsonValueWriter() if route.json else None
        self._text = ""

    def _call(self, final: bool) -> bool:
        before, marker, after = self.body_end(final)
        if marker is None and final:
            before, after = before + after, ""
        writer = self._writer
        if writer is not None and not writer.done and writer.error is None:
            used, written = writer.feed(before, final or marker is not None)
            self.emit_args(written)
            if writer.error is not None and not writer.started:
                self._writer, self._text = None, before[used:]  # not JSON: a text body
        elif writer is None:
            self._text += before
        self._buf = after
        if marker is None and not final:
            return False
        self._end_call()
        self.end_body(marker)
        return marker is not None

    def _end_call(self) -> None:
        writer = self._writer
        if writer is None:
            self.emit_args(dumps(self._text))
        elif not writer.started:
            self.emit_args("{}")
        elif not writer.done:
            self.emit_args(writer.close())
        self._writer = None
        self.end_call()
