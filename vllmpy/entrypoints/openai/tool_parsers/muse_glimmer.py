"""muse_glimmer: MuseGlimmer writes addressed messages, and its calls as ATEM XML in the
messages addressed to a tool::

    <|start|>assistant to=self<|message|>I should look it up.<|eom|>
    <|start|>assistant to=get_weather<|message|><atem:function_calls>
    <atem:invoke name="get_weather">
    <atem:parameter name="city">Paris</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eom|>
    <|start|>assistant to=user<|message|>It is sunny.<|eot|>

(the first message's header is `` to=self`` alone: the prompt wrote ``<|start|>assistant``).
Messages to ``user``, or to no one, are content; ``self`` is reasoning, not content, and is
dropped here. Only a tool message's invokes are calls, so an invoke quoted in reasoning or
in the answer is not. A parameter's value is read as JSON when it is JSON, else kept as
text. A doubled name (``get_weather.get_weather``, which the template's recipient list
invites for a tool without a namespace) is the registered ``get_weather``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vllmpy.entrypoints.openai.tool_parsers.abstract import Tools
from vllmpy.entrypoints.openai.tool_parsers.channel_messages import (
    START,
    ChannelMessagesParser,
    Route,
)
from vllmpy.entrypoints.openai.tool_parsers.xml_calls import XmlCallsToolParser
from vllmpy.reasoning.abstract import split_at_marker

_RECIPIENT = re.compile(r"to=([A-Za-z0-9_.\-]+)")


class MuseGlimmerToolParser(ChannelMessagesParser, XmlCallsToolParser):
    needs_special_tokens = True  # the message markers are special tokens
    ends = ("<|eom|>", "<|eot|>")
    invoke_tag = "atem:invoke"
    param_tag = "atem:parameter"
    call_state = "tool"

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state, self._return = "header", "tool"

    def _parse(self, final: bool) -> None:
        step = {**self.channel_states(), **self.xml_states(), "tool": self._tool}
        while step[self._state](final):
            pass

    def route(self, header: str) -> Route:
        recipient = _RECIPIENT.search(header)
        who = recipient.group(1) if recipient else None
        if who is None or who == "user":
            return Route("content")
        if who == "self":
            return Route("drop")
        return Route("call", who)

    def begin_call(self, route: Route) -> None:
        """A tool message: its invokes are read as they come."""

    def _tool(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (self.invoke_start, *self.ends, START))
        self._buf = after if marker is not None or not final else ""
        if marker is None:
            return False
        if marker == self.invoke_start:
            self._state = "x_head"
        else:
            self.end_body(marker)
        return True

    def call_name(self, name: str) -> str:
        head, dot, tail = name.partition(".")
        if dot and head == tail and head in self.functions and name not in self.functions:
            return head
        return name

    def convert(self, function: str, param: str, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text
