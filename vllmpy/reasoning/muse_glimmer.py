"""muse_glimmer: the ATEM channels of Muse Glimmer.

The template ends the prompt with ``<|start|>assistant``; the model then writes one
channel after another, each a header and a body::

     to=self<|message|>reasoning<|eom|><|start|>assistant to=user<|message|>answer<|eot|>

A header is ``to=RECIPIENT<|message|>`` (``<|message|>`` alone means the user), with
``<|start|>`` and the role in front of every channel but the first. A body ends at
``<|eom|>`` or ``<|eot|>``, at the next ``<|start|>``, or at a header written straight into
it (the model sometimes switches channel without closing the one it was in).

- ``to=self`` bodies are the reasoning, joined by a newline when there are several;
- ``to=user`` bodies are the content; the framing never reaches either;
- the first channel to any other recipient is a tool call: from its header on, the rest of
  the output is content as written, framing included, for the tool parser;
- output that does not open with a header is content up to the next ``<|start|>``.

The framing tokens are special tokens, so the request keeps special tokens.
"""

from __future__ import annotations

import re

from vllmpy.reasoning.abstract import ReasoningDelta, ReasoningParser, split_at_marker

START = "<|start|>"
MESSAGE = "<|message|>"
EOM = "<|eom|>"
EOT = "<|eot|>"
TO = "to="
_ROLE_END = re.compile(r"[\s<=]")
_RECIPIENT_END = re.compile(r"[\s<]")
# a header written into a body ("to=NAME" right before <|message|>), and a body's tail
# that may still grow into one (held back until the text after it tells)
_INLINE_HEADER = re.compile(r"to=([^\s<]+)$")
_HEADER_TAIL = re.compile(r"(?:t|to|to=[^\s<]*)$")


def _literal(text: str, pos: int, literal: str) -> int:
    """1 when ``literal`` is at ``pos``, 0 when the text ends inside it, -1 otherwise."""
    piece = text[pos:pos + len(literal)]
    if piece == literal:
        return 1
    return 0 if literal.startswith(piece) and pos + len(piece) == len(text) else -1


def _skip(text: str, pos: int, stop: re.Pattern[str]) -> int:
    found = stop.search(text, pos)
    return found.start() if found else len(text)


def match_header(text: str) -> tuple[int, str | None]:
    """Whether ``text`` opens with a channel header: ``(length, recipient)`` when it does
    (recipient None for a bare ``<|message|>``), ``(0, None)`` while the text may still
    grow into one, ``(-1, None)`` when it cannot."""
    pos = len(text) - len(text.lstrip())
    got = _literal(text, pos, START)
    if got == 0:
        return 0, None
    if got == 1:
        pos = _skip(text, pos + len(START), _ROLE_END)
        pos = len(text) - len(text[pos:].lstrip())
    recipient = None
    got = _literal(text, pos, TO)
    if got == 0:
        return 0, None
    if got == 1:
        end = _skip(text, pos + len(TO), _RECIPIENT_END)
        recipient, pos = text[pos + len(TO):end], end
    got = _literal(text, pos, MESSAGE)
    if got == 1:
        return pos + len(MESSAGE), recipient or None
    return (0, None) if got == 0 else (-1, None)


class MuseGlimmerReasoningParser(ReasoningParser):
    start = TO + "self" + MESSAGE
    end = EOM
    needs_special_tokens = True

    def initial_mode(self, prompt_state: str | None) -> str:
        # the channel being read ("self" or "user"), and whether a to=self one was opened
        self._recipient = "self" if prompt_state == "open" else "user"
        self._reasoned = prompt_state == "open"
        return "body" if prompt_state == "open" else "header"

    def _mode_header(self, out: ReasoningDelta, final: bool) -> bool:
        """Between channels: a header opens the next one; anything else is content."""
        size, recipient = match_header(self._buf)
        if size > 0:
            self._buf = self._buf[size:]
            self._enter(out, recipient)
            return True
        if size == 0 and not final:
            return False
        if size == 0 and self._buf.lstrip().startswith(START):
            self._buf = ""  # a header cut off by the end of the output: framing only
            return False
        self._mode = "outside"
        return True

    def _mode_outside(self, out: ReasoningDelta, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (START,))
        out.content += before + ("" if marker or not final else after)
        if marker is None:
            self._buf = "" if final else after
            return False
        size, _ = match_header(marker + after)
        if size < 0:  # a <|start|> that opens no channel is dropped as framing
            self._buf = after
            return True
        self._buf = marker + after
        self._mode = "header"
        return True

    def _mode_body(self, out: ReasoningDelta, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (EOM, EOT, START, MESSAGE))
        if marker is None:
            if final:
                self._emit(out, before + after)
                self._buf = ""
            else:
                held = self._header_tail(before)
                self._emit(out, before[:len(before) - len(held)])
                self._buf = held + after
            return False
        if marker == MESSAGE:
            inline = _INLINE_HEADER.search(before)
            if inline is None:  # a bare <|message|> inside a body is body text
                self._emit(out, before + marker)
                self._buf = after
                return True
            self._emit(out, before[:inline.start()])
            self._buf = after
            self._enter(out, inline.group(1))
            return True
        self._emit(out, before)
        self._buf = marker + after if marker == START else after
        self._mode = "header"
        return True

    @staticmethod
    def _header_tail(text: str) -> str:
        tail = _HEADER_TAIL.search(text)
        return tail.group(0) if tail else ""

    def _enter(self, out: ReasoningDelta, recipient: str | None) -> None:
        recipient = recipient or "user"
        if recipient not in ("self", "user"):
            out.content += TO + recipient + MESSAGE
            self._mode = "content"
            return
        if recipient == "self":
            out.reasoning += "\n" if self._reasoned else ""
            self._reasoned = True
        self._recipient = recipient
        self._mode = "body"

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self._recipient == "self":
            out.reasoning += text
        else:
            out.content += text
