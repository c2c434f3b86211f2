"""kimi_k3: Moonshot Kimi K3 answers in XTML channels, its reply in ``response`` and its
calls in ``tools`` (``<|open|>``, ``<|close|>`` and ``<|sep|>`` are special tokens)::

    <|open|>response<|sep|>Let me check.<|close|>response<|sep|>
    <|open|>tools<|sep|>
    <|open|>call tool="get_weather" index="1"<|sep|>
    <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>
    <|close|>call<|sep|>
    <|close|>tools<|sep|>

The response channel's text is the content; its markers, and the message's closing
marker, are not (the chat template often opens the channel in the prompt, so the output
may start inside it). A ``type="string"`` argument is its text as written; any other
type is JSON (text when it is not JSON). A call may carry its arguments as one JSON
object instead, in ``<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>``.
Attribute values are unescaped (``&quot;``, ``&amp;``). A call ends the turn: text after
the tools channel is dropped.
"""

from __future__ import annotations

import json

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.minimax_m2 import tag_attributes
from vllmpy.entrypoints.openai.tool_parsers.xml_args import ArgsWriter
from vllmpy.reasoning.abstract import split_at_marker

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
RESPONSE_OPEN, RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"
TOOLS_OPEN, TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
CALL_OPEN, CALL_CLOSE = f"{OPEN}call", f"{CLOSE}call{SEP}"
ARG_OPEN, ARG_CLOSE = f"{OPEN}argument", f"{CLOSE}argument{SEP}"
JSON_OPEN, JSON_CLOSE = f"{OPEN}json", f"{CLOSE}json{SEP}"
_MAX_TAG = 512  # an opening tag longer than this without its <|sep|> is not markup


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


class KimiK3ToolParser(ToolParser):
    needs_special_tokens = True  # the XTML markers are special tokens

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        # text | tools | call | params | tag | value | json | after
        self._state = "text"
        self._args: ArgsWriter | None = None
        self._tag = ""  # the opening tag being read: CALL_OPEN, ARG_OPEN or JSON_OPEN
        self._json = ""  # a json block's text, collected

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "tools": self._tools, "params": self._params,
                "tag": self._read_tag, "value": self._value, "json": self._json_block,
                "after": self._after}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        markers = (RESPONSE_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE, TOOLS_OPEN)
        marker = self.scan_content(markers, final)
        if marker == TOOLS_OPEN:
            self._state = "tools"
        return marker is not None  # the other markers are dropped

    def _tools(self, final: bool) -> bool:
        """Between calls: the next call or the channel's end; the rest is dropped."""
        _, marker, after = split_at_marker(self._buf, (CALL_OPEN, TOOLS_CLOSE))
        self._buf = "" if final and marker is None else after
        if marker == CALL_OPEN:
            self._tag, self._state = CALL_OPEN, "tag"
        elif marker == TOOLS_CLOSE:
            self._state = "after"
        return marker is not None

    def _read_tag(self, final: bool) -> bool:
        """An opening tag's attributes, up to its <|sep|>."""
        before, marker, after = split_at_marker(self._buf, (SEP,))
        if marker is None:
            if not final and len(before) <= _MAX_TAG:
                return False
            self._buf = ""
            self._end_call_if_open()
            self._state = "tools"
            return True
        self._buf = after
        attributes = {k: _unescape(v) for k, v in tag_attributes(before).items()}
        if self._tag == CALL_OPEN:
            name = attributes.get("tool", "").strip()
            if name and not before[:1].strip():  # "call tool=..." (not "calls")
                self.start_call(name)
                self._args = ArgsWriter(self, name)
            self._state = "params" if self._args is not None else "tools"
        elif self._tag == ARG_OPEN:
            assert self._args is not None
            kind = "string" if attributes.get("type", "string") == "string" else "json"
            self._args.begin(attributes.get("key", ""), kind)
            self._state = "value"
        else:
            self._json, self._state = "", "json"
        return True

    def _params(self, final: bool) -> bool:
        markers = (ARG_OPEN, JSON_OPEN, CALL_CLOSE, TOOLS_CLOSE)
        _, marker, after = split_at_marker(self._buf, markers)
        self._buf = "" if final and marker is None else after
        if marker in (ARG_OPEN, JSON_OPEN):
            self._tag, self._state = marker, "tag"
            return True
        if marker is not None or final:
            self._end_call_if_open()
            self._state = "after" if marker == TOOLS_CLOSE else "tools"
        return marker is not None

    def _value(self, final: bool) -> bool:
        assert self._args is not None
        before, marker, after = split_at_marker(self._buf, (ARG_CLOSE, CALL_CLOSE))
        if marker is None and not final:
            self._args.add(before)
            self._buf = after
            return False
        self._args.add(before if marker is not None else before + after)
        self._args.end()
        self._buf = after if marker == ARG_CLOSE else (marker or "") + after
        self._state = "params"
        return True

    def _json_block(self, final: bool) -> bool:
        """A call's arguments as one JSON object: each of its members is an argument."""
        before, marker, after = split_at_marker(self._buf, (JSON_CLOSE, CALL_CLOSE))
        self._json += before if marker is not None or not final else before + after
        if marker is None and not final:
            self._buf = after
            return False
        try:
            members = json.loads(self._json)
        except ValueError:
            members = None  # not JSON: no arguments come of it
        if isinstance(members, dict):
            assert self._args is not None
            for key, value in members.items():
                self._args.put(key, value)
        self._buf = after if marker == JSON_CLOSE else (marker or "") + after
        self._state = "params"
        return True

    def _end_call_if_open(self) -> None:
        if self._args is not None:
            self._args.finish()
            self._args = None
            self.end_call()

    def _after(self, final: bool) -> bool:
        self._buf = ""
        return False
