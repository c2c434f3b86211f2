"""pythonic: Llama 3.2 / 4 and others write the whole output as a Python list of calls with
keyword arguments (optionally between ``<|python_start|>`` and ``<|python_end|>``)::

    [get_weather(city="San Francisco", metric=True), get_time()]

Argument values are Python literals (strings, numbers, True/False/None, lists, dicts);
they become JSON. Output that does not start with ``[`` is content. Each call is sent once
its closing parenthesis arrives. A list that turns out not to be calls (a positional
argument, a value that is not a literal) is content from the first call that fails.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools, dumps

START, END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "head"  # head | list | tail | content
        self._raw = ""  # text read since the last finished call, given back on failure
        self._prefixed = False
        self._item = ""  # the call being read
        self._depth = 0  # brackets open inside the list
        self._quote: str | None = None
        self._escaped = False

    def _parse(self, final: bool) -> None:
        step = {"head": self._head, "list": self._list, "tail": self._tail,
                "content": self._content}
        while step[self._state](final):
            pass

    def _head(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not final and (not stripped or (not self._prefixed and START.startswith(stripped))):
            return False
        if not self._prefixed and stripped.startswith(START):
            self._raw += self._buf[:len(self._buf) - len(stripped)] + START
            self._buf, self._prefixed = stripped[len(START):], True
            return True
        if stripped.startswith("["):
            self._raw += self._buf[:len(self._buf) - len(stripped) + 1]
            self._buf = stripped[1:]
            self._state = "list"
        else:
            self._give_back()
        return True

    def _list(self, final: bool) -> bool:
        buf, i = self._buf, 0
        while i < len(buf):
            ch = buf[i]
            if self._quote is None and self._depth == 0:
                if not self._item.strip() and ch in " \t\r\n,]":
                    self._raw += ch
                    i += 1
                    if ch == "]":
                        self._buf, self._state = buf[i:], "tail"
                        return True
                    continue
                if ch in ",]":
                    return self._fail(buf[i:])  # an item that is not a call
            self._raw += ch
            self._item += ch
            i += 1
            if not self._scan(ch):
                return self._fail(buf[i:])
        self._buf = ""
        return self._fail("") if final else False

    def _scan(self, ch: str) -> bool:
        """Track strings and brackets; send the item when its parentheses close."""
        if self._quote is not None:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == self._quote:
                self._quote = None
        elif ch in "'\"":
            self._quote = ch
        elif ch in "([{":
            self._depth += 1
        elif ch in ")]}":
            self._depth -= 1
            if self._depth < 0:
                return False
            if self._depth == 0:
                return self._finish_item()
        return True

    def _finish_item(self) -> bool:
        """The item just closed its parentheses: send it as a call. False if it is none."""
        try:
            name, arguments = parse_call(self._item)
        except (SyntaxError, ValueError, TypeError):
            return False
        self.start_call(name)
        self.emit_args(arguments)
        self.end_call()
        self._item, self._raw = "", ""
        return True

    def _fail(self, rest: str) -> bool:
        """Not calls after all: content from the start of the output when no call was sent,
        else from the item that failed."""
        self._buf = (self._raw if self.num_calls == 0 else self._item) + rest
        self._item, self._raw = "", ""
        self._state = "content"
        return True

    def _tail(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not final and self._prefixed and (not stripped or END.startswith(stripped)):
            return False
        if self._prefixed and stripped.startswith(END):
            self._buf = stripped[len(END):]
        elif self._prefixed and END.startswith(stripped):
            self._buf = ""  # the end marker, cut short
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


def parse_call(text: str) -> tuple[str, str]:
    """``name(key=literal, ...)`` -> (name, arguments JSON). Raises SyntaxError,
    ValueError or TypeError for anything else."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)):
        raise ValueError(f"not a function call: {text!r}")
    if node.args:
        raise ValueError(f"positional arguments in {text!r}; calls take keyword arguments")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError(f"**kwargs in {text!r}")
        arguments[keyword.arg] = ast.literal_eval(keyword.value)
    json.dumps(arguments)  # a value JSON cannot hold raises TypeError
    return ast.unparse(node.func), dumps(arguments)
