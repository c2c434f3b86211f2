"""Formats whose tool calls are the whole output: optional prefix markers, then JSON call
objects or an array of them from the first character. Output that does not start so is
content; so is whatever follows the calls."""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.json_stream import CallArrayReader, CallObjectReader


class LeadingJsonToolParser(ToolParser):
    prefixes: tuple[str, ...] = ()  # markers that may come first, one of them at most
    opener = "{"  # "{": call objects, "[": one array of call objects
    separator: str | None = None  # between call objects (llama3_json writes ';')
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "head"  # head | calls | separator | content
        self._prefixed = False
        self._reader: CallObjectReader | CallArrayReader | None = None
        self._raw = ""  # text read since the last finished call, given back on failure

    def _parse(self, final: bool) -> None:
        step = {"head": self._head, "calls": self._calls, "separator": self._separator,
                "content": self._content}
        while step[self._state](final):
            pass

    def _head(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not self._prefixed:
            for prefix in self.prefixes:
                if stripped.startswith(prefix):
                    self._raw += self._buf[:len(self._buf) - len(stripped)] + prefix
                    self._buf, self._prefixed = stripped[len(prefix):], True
                    return True
                if not final and prefix.startswith(stripped):
                    return False
        if not stripped and not final:
            return False
        if stripped.startswith(self.opener):
            self._raw += self._buf[:len(self._buf) - len(stripped)]
            self._buf = stripped
            self._start_reader()
        else:
            self._give_back()
        return True

    def _start_reader(self) -> None:
        self._state = "calls"
        self._reader = (CallArrayReader(self, self.args_keys) if self.opener == "["
                        else CallObjectReader(self, self.args_keys))

    def _calls(self, final: bool) -> bool:
        reader = self._reader
        assert reader is not None
        used = reader.feed(self._buf, final)
        self._raw += self._buf[:used]
        self._buf = self._buf[used:]
        if reader.done:
            self._raw = ""
            self._state = "separator" if self.separator else "content"
            return True
        if reader.error is None and not final:
            return False
        if reader.close():  # an opened call is finished; the rest is content
            self._raw = ""
            self._state = "content"
        else:
            self._give_back()
        return True

    def _separator(self, final: bool) -> bool:
        assert self.separator is not None
        stripped = self._buf.lstrip()
        if not final and (not stripped or self.separator.startswith(stripped)):
            return False
        rest = stripped[len(self.separator):].lstrip()
        if stripped.startswith(self.separator) and rest.startswith(self.opener):
            self._raw = self._buf[:len(self._buf) - len(rest)]
            self._buf = rest
            self._start_reader()
        elif stripped.startswith(self.separator) and not final and not rest:
            return False
        else:
            self._state = "content"
        return True

    def _content(self, final: bool) -> bool:
        self.emit_content(self._buf)
        self._buf = ""
        return False

    def _give_back(self) -> None:
        self.emit_content(self._raw)
        self._raw = ""
        self._state = "content"
