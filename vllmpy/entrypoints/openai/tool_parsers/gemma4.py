"""gemma4: Gemma 4 writes a call as ``call:NAME{ARGS}`` between special tokens::

    Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

ARGS are ``key:value`` pairs: strings between ``<|"|>`` delimiters (kept verbatim), bare
numbers, ``true`` / ``false`` / ``null``, nested ``{...}`` objects (keys bare or
delimited) and ``[...]`` lists; another bare word is a string. They become JSON and
stream as they arrive. ``<turn|>`` may end a call instead of ``<tool_call|>``.

The OpenAI chat path reads the text seam as well: a bare ``call:NAME{ARGS}`` at the start
of the output or after whitespace (what is left when the special tokens were dropped
while detokenizing) is a call too. Text around the calls is content.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.reasoning.abstract import split_at_marker

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = {"true": "true", "false": "false", "null": "null", "None": "null",
             "True": "true", "False": "false"}
_NAME_CHARS = re.compile(r"[\w.\-]*")
_MAX_NAME = 256


def _bare_value(token: str) -> str:
    """A bare word's JSON: a literal, a number, else the word as a string."""
    token = token.strip()
    if token in _LITERALS:
        return _LITERALS[token]
    if _NUMBER.fullmatch(token):
        return json.dumps(json.loads(token))
    return json.dumps(token, ensure_ascii=False)


class GemmaArgsWriter:
    """Gemma's argument syntax in, JSON text out, piece by piece. It starts after the
    call's ``{`` (written with the first piece) and is ``done`` after the matching ``}``.
    Fed whole or in pieces it writes the same text; ``close()`` completes an argument
    list cut short so that what was written parses."""

    def __init__(self, delim: str) -> None:
        self.delim = delim
        self._stack = ["{"]
        # key | key_text | colon | value | bare | string | after
        self._state = "key"
        self._text = ""  # a bare key or value being read
        self._sep = ""  # ", " written before the next item once it starts
        self._key_string = False  # the open string is a key
        self._need_value = False  # ": " was written, the value has not started
        self._opened = False
        self.done = False

    def feed(self, text: str, final: bool = False) -> tuple[int, str]:
        """Read from ``text``; returns (characters consumed, JSON written). A delimiter
        cut across pieces is left unconsumed until the next piece (or ``final``)."""
        out: list[str] = [] if self._opened else ["{"]
        self._opened = True
        i = 0
        while i < len(text) and not self.done:
            step = (self._string(text, i, out, final) if self._state == "string"
                    else self._structural(text, i, out, final))
            if step is None:
                break
            i = step
        if final and self._state == "bare":
            self._end_bare(out)
        return i, "".join(out)

    def close(self) -> str:
        if self.done:
            return ""
        out: list[str] = []
        if self._state == "string":
            out.append('": null' if self._key_string else '"')
        elif self._state == "bare":
            self._end_bare(out)
        elif self._state == "key_text" and self._text.strip():
            out.append(self._sep + json.dumps(self._text.strip(), ensure_ascii=False)
                       + ": null")
        elif self._state == "colon":
            out.append(": null")
        elif self._need_value:
            out.append("null")
        out.extend("}" if opener == "{" else "]" for opener in reversed(self._stack))
        self.done = True
        return "".join(out)

    def _structural(self, text: str, i: int, out: list[str], final: bool) -> int | None:
        ch, state = text[i], self._state
        if state in ("key", "value"):
            if text.startswith(self.delim, i):
                out.append(self._sep + '"')
                self._sep, self._need_value = "", False
                self._key_string, self._state = state == "key", "string"
                return i + len(self.delim)
            if not final and self.delim.startswith(text[i:]):
                return None  # perhaps a delimiter: wait for the rest of it
        if state == "key_text":
            if ch != ":":
                self._text += ch
                return i + 1
            out.append(self._sep + json.dumps(self._text.strip(), ensure_ascii=False) + ": ")
            self._sep, self._text, self._state, self._need_value = "", "", "value", True
            return i + 1
        if state == "bare":
            if ch in ",}]":
                self._end_bare(out)
                return i
            self._text += ch
            return i + 1
        if ch in " \t\r\n":
            return i + 1
        if state == "colon":
            if ch == ":":
                out.append(": ")
                self._state, self._need_value = "value", True
                return i + 1
            out.append(": null")  # a key with no value
            self._state = "after"
            return i
        if ch == "," and state in ("after", "key", "value"):
            if state == "after":
                self._sep = ", "
                self._state = "key" if self._stack[-1] == "{" else "value"
            return i + 1
        if ch in "}]" and (state == "after" or (state == "key" and ch == "}") or
                           (state == "value" and (ch == "]" or self._need_value))):
            if self._need_value:
                out.append("null")
            self._close_container(out)
            return i + 1
        if state == "key":
            self._state, self._text = "key_text", ch
        elif state == "value" and ch in "{[":
            out.append(self._sep + ch)
            self._sep, self._need_value = "", False
            self._stack.append(ch)
            self._state = "key" if ch == "{" else "value"
        elif state == "value":
            self._state, self._text = "bare", ch
        else:  # a value right after a value: read it as the next item
            self._sep = ", "
            self._state = "key" if self._stack[-1] == "{" else "value"
            return i
        return i + 1

    def _string(self, text: str, i: int, out: list[str], final: bool) -> int | None:
        at = text.find(self.delim, i)
        if at < 0:
            hold = 0 if final else next(
                (n for n in range(min(len(self.delim) - 1, len(text) - i), 0, -1)
                 if text.endswith(self.delim[:n])), 0)
            end = len(text) - hold
            out.append(json.dumps(text[i:end], ensure_ascii=False)[1:-1])
            return end if end > i else None
        out.append(json.dumps(text[i:at], ensure_ascii=False)[1:-1] + '"')
        if self._key_string:
            self._state, self._key_string = "colon", False
        else:
            self._after_value()
        return at + len(self.delim)

    def _end_bare(self, out: list[str]) -> None:
        out.append(self._sep + _bare_value(self._text))
        self._sep, self._text, self._need_value = "", "", False
        self._after_value()

    def _close_container(self, out: list[str]) -> None:
        opener = self._stack.pop()
        out.append("}" if opener == "{" else "]")
        self._sep, self._need_value = "", False
        self._after_value()

    def _after_value(self) -> None:
        self._state = "after"
        if not self._stack:
            self.done = True


class Gemma4EngineToolParser(ToolParser):
    needs_special_tokens = True  # the call markers and string delimiters are special tokens
    start: ClassVar[str] = "<|tool_call>"
    ends: ClassVar[tuple[str, ...]] = ("<tool_call|>", "<turn|>")
    delim: ClassVar[str] = '<|"|>'
    bare: ClassVar[bool] = True  # read a bare call:NAME{ARGS} too

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | prefix | name | args | tail
        self._raw = ""  # the markup read since the call began, given back if no call
        self._prev = ""  # the character before the text being scanned
        self._writer: GemmaArgsWriter | None = None

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "prefix": self._prefix, "name": self._name,
                "args": self._args, "tail": self._tail}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        markers = (self.start, "call:") if self.bare else (self.start,)
        before, marker, after = split_at_marker(self._buf, markers)
        if marker is None and final:
            before, after = before + after, ""
        self.emit_content(before)
        self._prev = before[-1:] or self._prev
        self._buf = after
        if marker is None:
            return False
        if marker == "call:" and self._prev not in ("", " ", "\t", "\n", "\r"):
            self.emit_content(marker)  # part of a word ("recall:"): content
            self._prev = ":"
            return True
        self._raw = marker
        self._state = "prefix" if marker == self.start else "name"
        return True

    def _prefix(self, final: bool) -> bool:
        """After the start marker: ``call:`` (or a bare ``:``) before the name."""
        for prefix in ("call:", ":"):
            if self._buf.startswith(prefix):
                self._raw += prefix
                self._buf = self._buf[len(prefix):]
                self._state = "name"
                return True
        if not final and "call:".startswith(self._buf):
            return False
        return self._give_back()

    def _name(self, final: bool) -> bool:
        name = _NAME_CHARS.match(self._buf).group()  # type: ignore[union-attr]
        rest = self._buf[len(name):]
        if not rest and not final and len(name) <= _MAX_NAME:
            return False
        if not name or not rest.startswith("{") or len(name) > _MAX_NAME:
            return self._give_back()
        self._buf = rest[1:]
        self.start_call(name)
        self._writer = GemmaArgsWriter(self.delim)
        self._state = "args"
        return True

    def _give_back(self) -> bool:
        """What began like a call is not one: its markup is content."""
        self.emit_content(self._raw)
        self._prev = self._raw[-1:]
        self._state = "text"
        return True

    def _args(self, final: bool) -> bool:
        writer = self._writer
        assert writer is not None
        used, written = writer.feed(self._buf, final)
        self.emit_args(written)
        self._buf = self._buf[used:]
        if not writer.done and not final:
            return False
        if not writer.done:
            self.emit_args(writer.close())
        self.end_call()
        self._state = "tail"
        return True

    def _tail(self, final: bool) -> bool:
        """After the arguments: the end marker, if one comes."""
        stripped = self._buf.lstrip()
        for end in self.ends:
            if stripped.startswith(end):
                self._buf = stripped[len(end):]
                break
            if end.startswith(stripped) and stripped and not final:
                return False
        else:
            if not stripped and not final:
                return False
            if final and any(end.startswith(stripped) for end in self.ends):
                self._buf = ""  # the end marker, cut short
        self._prev, self._state = "", "text"
        return True
