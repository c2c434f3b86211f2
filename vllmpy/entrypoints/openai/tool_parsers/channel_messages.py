"""Output made of addressed messages, the shape gpt-oss (harmony) and MuseGlimmer share::

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...

Each message has a header (up to ``<|message|>``; ``<|start|>`` opens the next one) and a
body that ends at one of the family's end markers or at the next ``<|start|>``. The prompt
opens the first message, so the output starts inside its header. A family routes each
header (``route``): its body is content, is dropped (reasoning, built-in tools), or holds
a call, which the family reads in its own states.

Output with no ``<|message|>`` in its first ``_MAX_HEADER`` characters is not framed at
all (the special tokens were dropped while detokenizing, say): it is content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.reasoning.abstract import split_at_marker

START, MESSAGE = "<|start|>", "<|message|>"
_MAX_HEADER = 512


@dataclass(frozen=True)
class Route:
    kind: str  # "content" | "drop" | "call"
    name: str = ""  # the function, for a call
    json: bool = True  # the call's body is JSON (else text, sent as a JSON string)


class ChannelMessagesParser(ToolParser):
    reads_messages = True
    ends: ClassVar[tuple[str, ...]] = ()
    call_state: ClassVar[str] = "call"  # the state a call's body is read in

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "header"
        self._header = ""
        self._framed = False  # a <|message|> was seen

    def route(self, header: str) -> Route:
        raise NotImplementedError

    def begin_call(self, route: Route) -> None:
        """A call's body starts (``self._buf`` holds it); set up its reading."""
        raise NotImplementedError

    def channel_states(self) -> dict[str, Any]:
        return {"header": self._read_header, "content": self._content, "drop": self._drop,
                "plain": self._plain}

    def body_end(self, final: bool) -> tuple[str, str | None, str]:
        """``split_at_marker`` of the buffer at the end of the current body."""
        return split_at_marker(self._buf, (*self.ends, START))

    def end_body(self, marker: str | None) -> None:
        """The body ended at ``marker`` (consumed; None: the output ended)."""
        self._state, self._header = "header", ""

    def _read_header(self, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (MESSAGE, START, *self.ends))
        self._header += before
        self._buf = after if marker is not None or not final else ""
        if marker is None:
            if final and not self._framed:
                self.emit_content(self._header + after)
            elif not self._framed and len(self._header) > _MAX_HEADER:
                self._buf, self._header = self._header + self._buf, ""
                self._state = "plain"
                return True
            return False
        if marker != MESSAGE:
            self._header = ""  # a new message, or an end marker with no body
            return True
        self._framed = True
        route = self.route(self._header)
        self._header = ""
        if route.kind == "call":
            self.begin_call(route)
            self._state = self.call_state
        else:
            self._state = route.kind
        return True

    def _content(self, final: bool) -> bool:
        before, marker, after = self.body_end(final)
        if marker is None and final:
            before, after = before + after, ""
        self.emit_content(before)
        self._buf = after
        if marker is None:
            return False
        self.end_body(marker)
        return True

    def _drop(self, final: bool) -> bool:
        _, marker, after = self.body_end(final)
        self._buf = after if marker is not None or not final else ""
        if marker is None:
            return False
        self.end_body(marker)
        return True

    def _plain(self, final: bool) -> bool:
        self.emit_content(self._buf)
        self._buf = ""
        return False
