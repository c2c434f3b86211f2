"""Calls written as Python function calls with keyword arguments inside a marked block,
the shape LFM2 and Olmo 3 share::

    <|tool_call_start|>[get_weather(city="Paris", days=3), get_time()]<|tool_call_end|>
    <function_calls>
    get_weather(city="Paris", days=3)
    get_time()
    </function_calls>

Items are separated by commas or newlines, optionally inside one ``[...]``. Argument
values are Python literals, and JSON's ``true`` / ``false`` / ``null`` are read too; they
become JSON. Each call is sent once its closing parenthesis arrives; a call cut short by
the end of the output is closed (its open string and brackets) when that makes it parse.
Text outside the block is content; a block that stops being calls is content from the
item that failed.
"""

from __future__ import annotations

import ast
import json
from typing import Any, ClassVar

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools, dumps

_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False,
               "None": None}
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def literal(node: ast.expr) -> Any:
    """A literal's value; raises ValueError for anything that is not a JSON-able literal."""
    if isinstance(node, ast.Constant) and (node.value is None or
                                           isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and
                                          isinstance(k.value, str) for k in node.keys):
        return {k.value: literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def parse_python_call(text: str) -> tuple[str, str]:
    """``name(key=literal, ...)`` -> (name, arguments JSON); ValueError for anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        raise ValueError(f"not Python: {text[:40]!r}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)):
        raise ValueError(f"not a function call: {text[:40]!r}")
    if node.args or any(k.arg is None for k in node.keywords):
        raise ValueError(f"a call takes keyword arguments only: {text[:40]!r}")
    arguments = {k.arg: literal(k.value) for k in node.keywords}
    json.dumps(arguments)
    return ast.unparse(node.func), dumps(arguments)


class PythonCallsToolParser(ToolParser):
    start: ClassVar[str] = ""
    end: ClassVar[str] = ""

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._state = "text"  # text | block
        self._raw = ""  # the block since its start marker, given back if no call comes
        self._item = ""
        self._stack: list[str] = []  # open brackets and the open quote of the item
        self._escaped = False
        self._block_calls = 0

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "block": self._block}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        if self.scan_content((self.start,), final) is None:
            return False
        self._state, self._raw, self._block_calls = "block", self.start, 0
        return True

    def _block(self, final: bool) -> bool:
        buf, i = self._buf, 0
        while i < len(buf):
            if not self._item and not self._stack:
                rest = buf[i:]
                if rest.startswith(self.end):
                    self._buf, self._state = rest[len(self.end):], "text"
                    self._raw = ""
                    return True
                if self.end.startswith(rest):
                    i = len(buf) if final else i  # the end marker cut short, or to come
                    break
                if rest[0] in " \t\r\n,[]":
                    self._raw += rest[0]
                    i += 1
                    continue
                if not (rest[0].isalpha() or rest[0] == "_"):
                    return self._fail(rest)
            ch = buf[i]
            self._item += ch
            self._raw += ch
            i += 1
            if not self._scan(ch):
                return self._fail(buf[i:])
        self._buf = buf[i:]
        if final:
            return self._finish_cut_short()
        return False

    def _scan(self, ch: str) -> bool:
        """Track the item's strings and brackets; send it when its parentheses close."""
        top = self._stack[-1] if self._stack else None
        if top in ("'", '"'):
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == top:
                self._stack.pop()
            return True
        if ch in "'\"" or ch in _CLOSERS:
            self._stack.append(ch)
        elif ch in ")]}":
            if top is None or _CLOSERS[top] != ch:
                return False
            self._stack.pop()
            if not self._stack:
                return self._send(self._item)
        elif ch in "\n," and not self._stack:
            return False  # an item that is not a call
        return True

    def _send(self, item: str) -> bool:
        try:
            name, arguments = parse_python_call(item)
        except ValueError:
            return False
        self.start_call(name)
        self.emit_args(arguments)
        self.end_call()
        self._item, self._block_calls = "", self._block_calls + 1
        return True

    def _finish_cut_short(self) -> bool:
        """The output ended: close an item cut short if that makes it a call; anything
        else left over is content."""
        if self._item:
            closing = "".join(_CLOSERS.get(c, c) for c in reversed(self._stack))
            if self._send(self._item + closing):
                self._stack, self._raw = [], ""
            else:
                return self._fail(self._buf)
        self._buf, self._state = "", "text"
        return False

    def _fail(self, rest: str) -> bool:
        """Not calls after all: content from the block's start when it sent no call, else
        from the item that failed."""
        self.emit_content(self._raw if self._block_calls == 0 else self._item)
        self._item, self._raw, self._stack, self._escaped = "", "", [], False
        self._buf, self._state = rest, "text"
        return True
