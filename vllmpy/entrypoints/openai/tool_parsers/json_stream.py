"""Reading JSON as it streams in, and writing it back in one canonical spelling.

``JsonValueWriter`` reads one JSON value from text fed in pieces and writes the value back
as soon as each part of it is certain: json.dumps spacing (``", "`` and ``": "``), strings
re-escaped as ``json.dumps(..., ensure_ascii=False)`` escapes them, numbers as written.
Fed whole or fed in pieces, it writes the same text, which is how a streamed call's
argument fragments equal the whole response's arguments. ``close()`` completes a value cut
short so that what was written still parses.

``CallObjectReader`` reads a ``{"name": ..., "arguments": {...}}`` object (the argument key
is configurable) and opens a call on the parser as soon as the name is known;
``CallArrayReader`` reads a JSON array of them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_TOKEN_CHARS = frozenset("+-.0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                   "r": "\r", "t": "\t"}


class JsonStreamError(ValueError):
    """The text is not JSON; ``at`` is the position of the offending character."""

    def __init__(self, message: str, at: int) -> None:
        super().__init__(message)
        self.at = at


def _escape(char: str) -> str:
    return json.dumps(char, ensure_ascii=False)[1:-1]


class JsonValueWriter:
    """One JSON value in, its canonical text out, piece by piece (see the module doc)."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # open containers, "{" or "["
        # value | key_or_end | key | colon | value_or_end | comma_or_end | string | token
        self._state = "value"
        self._string_is_key = False
        self._escape: str | None = None  # an escape being read, after the backslash
        self._high: str | None = None  # a \\uD8xx escape waiting for its low half
        self._token = ""
        self._sep = ""  # ", " written before the next item once it starts
        self._need_value = False  # ": " was written, the value has not started
        self.started = False
        self.done = False
        self.error: str | None = None  # set when the text stopped being JSON

    def feed(self, text: str, final: bool = False) -> tuple[int, str]:
        """Read from ``text``; returns (characters consumed, canonical text written). Stops
        right after the value ends (``done``), or at a character that is not JSON (``error``
        set, the character not consumed; feed no more then). With ``final``, a number or
        literal at the very end is taken as complete."""
        out: list[str] = []
        i, n = 0, len(text)
        if self.error is not None:
            return 0, ""
        try:
            while i < n and not self.done:
                if self._state == "string":
                    i = self._string(text, i, out)
                    continue
                ch = text[i]
                if self._state == "token":
                    if ch in _TOKEN_CHARS:
                        self._token += ch
                        i += 1
                        continue
                    self._end_token(out)
                    continue
                if ch in _WS:
                    i += 1
                    continue
                self._structural(ch, out)
                i += 1
            if final and self._state == "token" and not self.done:
                self._end_token(out)
        except JsonStreamError as e:
            self.error = str(e)
        return i, "".join(out)

    def close(self) -> str:
        """Text that completes what was written into valid JSON (the value is cut short)."""
        if self.done or not self.started:
            self.done = True
            return ""
        out: list[str] = []
        if self._state == "string":
            if self._high is not None:
                out.append(self._high)
            out.append('"')
            if self._string_is_key:
                out.append(": null")
        elif self._state == "token":
            out.append(self._token if self._token_ok() else "null")
        elif self._state == "colon":
            out.append(": null")
        elif self._need_value:
            out.append("null")
        for opener in reversed(self._stack):
            out.append("}" if opener == "{" else "]")
        self.done = True
        return "".join(out)

    # -- the automaton --------------------------------------------------------------------

    def _fail(self, what: str) -> JsonStreamError:
        return JsonStreamError(f"not JSON: {what}", 0)

    def _begin(self, out: list[str]) -> None:
        self.started = True
        self._need_value = False
        if self._sep:
            out.append(self._sep)
            self._sep = ""

    def _structural(self, ch: str, out: list[str]) -> None:
        state = self._state
        if state in ("value", "value_or_end"):
            if ch == "]" and state == "value_or_end":
                self._close_container("[", out)
            elif ch in "{[":
                self._begin(out)
                out.append(ch)
                self._stack.append(ch)
                self._state = "key_or_end" if ch == "{" else "value_or_end"
            elif ch == '"':
                self._begin(out)
                out.append('"')
                self._state, self._string_is_key = "string", False
            elif ch in _TOKEN_CHARS:
                self._begin(out)
                self._state, self._token = "token", ch
            else:
                raise self._fail(f"unexpected {ch!r} where a value should start")
        elif state in ("key_or_end", "key"):
            if ch == '"':
                self._begin(out)
                out.append('"')
                self._state, self._string_is_key = "string", True
            elif ch == "}" and state == "key_or_end":
                self._close_container("{", out)
            else:
                raise self._fail(f"unexpected {ch!r} where an object key should start")
        elif state == "colon":
            if ch != ":":
                raise self._fail(f"expected ':' after an object key, got {ch!r}")
            out.append(": ")
            self._state, self._need_value = "value", True
        elif state == "comma_or_end":
            top = self._stack[-1]
            if ch == ",":
                self._sep = ", "
                self._state = "key" if top == "{" else "value"
            elif ch == ("}" if top == "{" else "]"):
                self._close_container(top, out)
            else:
                where = "object" if top == "{" else "array"
                raise self._fail(f"expected ',' or the end of the {where}, got {ch!r}")

    def _close_container(self, opener: str, out: list[str]) -> None:
        self._stack.pop()
        out.append("}" if opener == "{" else "]")
        self._after_value()

    def _after_value(self) -> None:
        if not self._stack:
            self.done = True
            self._state = "value"
        else:
            self._state = "comma_or_end"

    def _token_ok(self) -> bool:
        return self._token in ("true", "false", "null") or bool(_NUMBER.fullmatch(self._token))

    def _end_token(self, out: list[str]) -> None:
        if not self._token_ok():
            raise self._fail(f"{self._token!r} is not a number, true, false or null")
        out.append(self._token)
        self._token = ""
        self._after_value()

    def _string(self, text: str, i: int, out: list[str]) -> int:
        """Read string characters from ``text[i:]``; returns the new position."""
        if self._escape is not None:
            return self._read_escape(text, i, out)
        ch = text[i]
        if self._high is not None and ch != "\\":
            out.append(self._high)  # a lone high surrogate stays escaped
            self._high = None
        if ch == '"':
            out.append('"')
            if self._string_is_key:
                self._state = "colon"
            else:
                self._after_value()
            return i + 1
        if ch == "\\":
            self._escape = ""
            return i + 1
        plain = _PLAIN.match(text, i)
        if plain is None:  # a raw control character: tolerated, written escaped
            out.append(_escape(ch))
            return i + 1
        out.append(plain.group())
        return plain.end()

    def _read_escape(self, text: str, i: int, out: list[str]) -> int:
        assert self._escape is not None
        self._escape += text[i]
        esc = self._escape
        if esc[0] != "u":
            if esc not in _SIMPLE_ESCAPES:
                raise self._fail(f"bad string escape \\{esc}")
            self._escape = None
            self._flush_high(out)
            out.append(_escape(_SIMPLE_ESCAPES[esc]))
            return i + 1
        if len(esc) < 5:
            return i + 1
        self._escape = None
        try:
            code = int(esc[1:], 16)
        except ValueError:
            raise self._fail(f"bad unicode escape \\{esc}") from None
        if 0xDC00 <= code <= 0xDFFF and self._high is not None:
            high = int(self._high[2:], 16)
            self._high = None
            out.append(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
        elif 0xD800 <= code <= 0xDBFF:
            self._flush_high(out)
            self._high = f"\\u{code:04x}"
        else:
            self._flush_high(out)
            out.append(f"\\u{code:04x}" if 0xDC00 <= code <= 0xDFFF else _escape(chr(code)))
        return i + 1

    def _flush_high(self, out: list[str]) -> None:
        if self._high is not None:
            out.append(self._high)
            self._high = None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def canonical_json(text: str) -> str | None:
    """The canonical spelling of ``text`` when it is exactly one JSON value, else None."""
    writer = JsonValueWriter()
    used, out = writer.feed(text, final=True)
    if not writer.done or text[used:].strip(_WS):
        return None
    return out


class CallObjectReader:
    """Reads one ``{"name": "...", "<args key>": {...}}`` object into a call on ``parser``.

    The call opens (id and name) as soon as the name string is complete; argument text
    read before the name waits for it. Arguments given as a string that holds JSON are
    decoded. An object without a name is refused; one without arguments has ``{}``.
    Text that is not such an object stops the reader with ``error`` set (the offending
    character not consumed); then it is either closed or abandoned.
    """

    def __init__(self, parser: ToolParser,
                 args_keys: Sequence[str] = ("arguments", "parameters")) -> None:
        self.parser = parser
        self.args_keys = tuple(args_keys)
        # open | key_or_end | key | key_string | colon | value | comma_or_end
        self.state = "open"
        self.done = False
        self.name: str | None = None
        self.call_open = False  # the call was started on the parser
        self.error: str | None = None
        self._key = ""
        self._writer = JsonValueWriter()
        self._text = ""  # written text of a key, a name or a string-valued argument
        self._held_args = ""  # argument text read before the name
        self._args_seen = False
        self._args_streaming = False  # the value being read is the arguments object

    def feed(self, text: str, final: bool = False) -> int:
        """Read from ``text``; returns characters consumed (it stops after the object)."""
        i = 0
        if self.error is not None:
            return 0
        try:
            while i < len(text) and not self.done:
                if self.state in ("key_string", "value"):
                    i = self._feed_writer(text, i, final)
                    continue
                i = _skip_ws(text, i)
                if i < len(text):
                    i = self._structural(text[i], i)
            if final and self.state == "value" and not self.done:
                self._feed_writer(text, len(text), final=True)  # a number ending the text
        except JsonStreamError as e:
            self.error = str(e)
            return e.at
        return i

    def close(self) -> bool:
        """The text ended inside the object: finish the call if it has a name (True)."""
        if self.done:
            return True
        if self.name is None:
            return False
        self._open()
        if self.state == "value" and self._writer.started and not self._args_seen:
            if self._args_streaming:
                self.parser.emit_args(self._writer.close())
                self._args_seen = True
            elif self._key in self.args_keys:
                self._finish_string_args(self._text + self._writer.close())
        if not self._args_seen:
            self.parser.emit_args("{}")
        self.parser.end_call()
        self.done = True
        return True

    def _structural(self, ch: str, i: int) -> int:
        state = self.state
        if state == "open":
            if ch != "{":
                raise JsonStreamError(f"a tool call must be a JSON object, got {ch!r}", i)
            self.state = "key_or_end"
        elif state in ("key_or_end", "key"):
            if ch == "}" and state == "key_or_end":
                return self._end(i)
            if ch != '"':
                raise JsonStreamError(f"expected an object key, got {ch!r}", i)
            self.state, self._writer, self._text = "key_string", JsonValueWriter(), ""
            return i  # the writer reads the key string, quote included
        elif state == "colon":
            if ch != ":":
                raise JsonStreamError(f"expected ':' after a key, got {ch!r}", i)
            self.state, self._writer, self._text = "value", JsonValueWriter(), ""
            self._args_streaming = False
        elif ch == ",":
            self.state = "key"
        elif ch == "}":
            return self._end(i)
        else:
            raise JsonStreamError(f"expected ',' or '}}' in a tool call, got {ch!r}", i)
        return i + 1

    def _feed_writer(self, text: str, i: int, final: bool) -> int:
        writer = self._writer
        if not writer.started:
            i = _skip_ws(text, i)
            if i >= len(text):
                return i
            if self.state == "value":
                self._args_streaming = (self._key in self.args_keys and not self._args_seen
                                        and text[i] != '"')
        used, written = writer.feed(text[i:], final)
        if self._args_streaming:
            self._emit_args(written)
        else:
            self._text += written
        if writer.error is not None:
            raise JsonStreamError(writer.error, i + used)
        if writer.done:
            if self.state == "key_string":
                self._key, self.state = json.loads(self._text), "colon"
            else:
                self._value_done(i + used)
            self._text = ""
        return i + used

    def _value_done(self, at: int) -> None:
        key = self._key
        if key == "name" and self.name is None:
            name = json.loads(self._text)
            if not isinstance(name, str) or not name:
                raise JsonStreamError(f"a tool call's name must be a non-empty string, got "
                                      f"{self._text}", at)
            self.name = name
            self._open()
        elif key in self.args_keys and not self._args_seen:
            if self._args_streaming:
                self._args_seen = True
            else:
                self._finish_string_args(self._text)
        self.state, self._args_streaming = "comma_or_end", False

    def _finish_string_args(self, written: str) -> None:
        """Arguments written as a JSON string: the JSON it holds, else the string itself."""
        decoded = json.loads(written)
        canonical = canonical_json(decoded) if isinstance(decoded, str) else None
        self._args_seen = True
        self._emit_args(written if canonical is None else canonical)

    def _emit_args(self, fragment: str) -> None:
        if self.call_open:
            self.parser.emit_args(fragment)
        else:
            self._held_args += fragment

    def _open(self) -> None:
        if not self.call_open:
            assert self.name is not None
            self.parser.start_call(self.name)
            self.call_open = True
            self.parser.emit_args(self._held_args)
            self._held_args = ""

    def _end(self, i: int) -> int:
        if self.name is None:
            raise JsonStreamError('a tool call object has no "name"', i)
        self._open()
        if not self._args_seen:
            self.parser.emit_args("{}")
        self.parser.end_call()
        self.done = True
        return i + 1


class CallArrayReader:
    """Reads a JSON array of call objects (``[]`` included) into calls on ``parser``; each
    item is read by ``make_item()`` (by default a ``CallObjectReader`` over
    ``args_keys``), a reader with ``feed``, ``close``, ``done`` and ``error``."""

    def __init__(self, parser: ToolParser,
                 args_keys: Sequence[str] = ("arguments", "parameters"),
                 make_item: Callable[[], Any] | None = None) -> None:
        self.parser = parser
        self.make_item = make_item or (lambda: CallObjectReader(parser, args_keys))
        self.state = "open"  # open | item_or_end | item | comma_or_end
        self.item: Any = None
        self.done = False
        self.error: str | None = None
        self._first_call = parser.num_calls

    @property
    def call_open(self) -> bool:
        """A call of this array was started on the parser."""
        return self.parser.num_calls > self._first_call

    def feed(self, text: str, final: bool = False) -> int:
        """As ``CallObjectReader.feed``, for the array."""
        i = 0
        while i < len(text) and not self.done and self.error is None:
            if self.item is not None:
                i += self.item.feed(text[i:], final)
                self.error = self.item.error
                if self.item.done:
                    self.item, self.state = None, "comma_or_end"
                continue
            i = _skip_ws(text, i)
            if i >= len(text):
                break
            ch = text[i]
            if self.state == "open":
                if ch != "[":
                    self.error = f"expected a JSON array of tool calls, got {ch!r}"
                    break
                self.state = "item_or_end"
            elif ch == "]" and self.state in ("item_or_end", "comma_or_end"):
                self.done = True
            elif ch == "," and self.state == "comma_or_end":
                self.state = "item"
            elif self.state in ("item_or_end", "item"):
                self.item = self.make_item()
                continue
            else:
                self.error = f"expected ',' or ']' between tool calls, got {ch!r}"
                break
            i += 1
        return i

    def close(self) -> bool:
        """The text ended inside the array: finish an opened call; True if it had calls."""
        if self.item is not None:
            self.item.close()
        self.done = True
        return self.call_open
