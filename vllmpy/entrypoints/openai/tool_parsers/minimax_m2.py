"""minimax_m2: MiniMax-M2 writes ``<invoke>`` elements with ``<parameter>`` children::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Its chat template writes a string value as it is and any other value as JSON, so values
are typed from the tool schema; a string keeps its whitespace. The name may be quoted
with ``"`` or ``'`` or not at all. An ``<invoke>`` outside the tags is a call too; text
after the tags is content.

``InvokeToolParser`` reads this shape of call for any spelling of its markers
(DeepSeek's DSML, StepFun's steptml): calls as invoke elements inside a section, each
parameter's attributes in its opening tag, text between the elements dropped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools
from vllmpy.entrypoints.openai.tool_parsers.xml_args import ArgsWriter
from vllmpy.reasoning.abstract import split_at_marker

_ATTR = re.compile(r"""([\w-]+)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")
_MAX_TAG = 512  # an opening tag longer than this without its '>' is not markup


def tag_attributes(text: str) -> dict[str, str]:
    """``name="x" string='true' k=v`` -> {"name": "x", "string": "true", "k": "v"}."""
    return {m.group(1): next(g for g in m.groups()[1:] if g is not None)
            for m in _ATTR.finditer(text)}


class InvokeToolParser(ToolParser):
    """Invoke-element calls; a family sets the markers below (see the module doc)."""

    section_starts: tuple[str, ...] = ()  # open the calls
    section_end = ""
    invoke = ""  # the start of a call, up to its name: '<invoke name='
    invoke_end = ""
    param = ""  # the start of a parameter's opening tag: '<parameter'
    param_end = ""
    bare_invoke = True  # an invoke outside the section is a call too
    drop_after_section = False  # text after the section is dropped, not content
    strip_values = False  # whitespace around a value is not part of it

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        # text | section | name | params | pattrs | pvalue
        self._state = "text"
        self._in_section = False
        self._args: ArgsWriter | None = None

    def value_kind(self, attributes: dict[str, str]) -> str | Sequence[str]:
        """How a parameter's value is typed (see ``xml_args``), from its tag."""
        return "schema"

    def _parse(self, final: bool) -> None:
        step = {"text": self._text, "section": self._section, "name": self._name,
                "params": self._params, "pattrs": self._pattrs, "pvalue": self._pvalue}
        while step[self._state](final):
            pass

    def _text(self, final: bool) -> bool:
        markers = (*self.section_starts, self.section_end,
                   *((self.invoke,) if self.bare_invoke else ()))
        marker = self.scan_content(markers, final)
        if marker is None:
            return False
        if marker == self.invoke:
            self._in_section, self._state = False, "name"
        elif marker != self.section_end:  # a stray end marker is dropped
            self._in_section, self._state = True, "section"
        return True

    def _section(self, final: bool) -> bool:
        """Between calls: the next invoke or the end of the section; the rest is dropped."""
        _, marker, after = split_at_marker(
            self._buf, (self.invoke, self.section_end, *self.section_starts))
        self._buf = "" if final and marker is None else after
        if marker == self.invoke:
            self._state = "name"
        elif marker == self.section_end and not self.drop_after_section:
            self._in_section, self._state = False, "text"
        return marker is not None

    def _name(self, final: bool) -> bool:
        buf = self._buf
        quote = buf[:1] if buf[:1] in ('"', "'") else ""
        close = buf.find(quote, 1) if quote else buf.find(">")
        if close < 0:
            if final or len(buf) > _MAX_TAG:
                return self._not_a_call()
            return False
        name = buf[1:close] if quote else buf[:close]
        rest = buf[close + 1:] if quote else buf[close:]
        stripped = rest.lstrip()
        if quote and not stripped and not final:
            return False  # the '>' after the quote is still to come
        if not stripped.startswith(">") or not name.strip() or "<" in name:
            return self._not_a_call()
        self._buf = stripped[1:]
        self.start_call(name.strip())
        self._args = ArgsWriter(self, name.strip(), strip=self.strip_values)
        self._state = "params"
        return True

    def _not_a_call(self) -> bool:
        """An invoke whose name is not one: content outside the section, else dropped."""
        if not self._in_section:
            self.emit_content(self.invoke)
        self._state = "section" if self._in_section else "text"
        return True

    def _params(self, final: bool) -> bool:
        _, marker, after = split_at_marker(
            self._buf, (self.param, self.invoke_end, self.section_end))
        self._buf = "" if final and marker is None else after
        if marker == self.param:
            self._state = "pattrs"
        elif marker is not None or final:
            self._end_invoke(marker)
        return marker is not None

    def _pattrs(self, final: bool) -> bool:
        at = self._buf.find(">")
        if at < 0:
            if final or len(self._buf) > _MAX_TAG:  # not a parameter after all
                self._state = "params"
                return True
            return False
        attributes = tag_attributes(self._buf[:at])
        self._buf = self._buf[at + 1:]
        name = attributes.get("name", "").strip()
        if not name:  # a parameter without a name: its value is dropped
            self._state = "params"
            return True
        assert self._args is not None
        self._args.begin(name, self.value_kind(attributes))
        self._state = "pvalue"
        return True

    def _pvalue(self, final: bool) -> bool:
        assert self._args is not None
        markers = (self.param_end, self.param, self.invoke_end, self.section_end)
        before, marker, after = split_at_marker(self._buf, markers)
        if marker is None and not final:
            self._args.add(before)
            self._buf = after
            return False
        self._args.add(before if marker is not None else before + after)
        self._args.end()
        self._buf = after if marker == self.param_end else (marker or "") + after
        self._state = "params"
        return marker is not None or final  # at the end, the invoke is closed next

    def _end_invoke(self, marker: str | None) -> None:
        assert self._args is not None
        self._args.finish()
        self.end_call()
        self._args = None
        if marker == self.section_end and not self.drop_after_section:
            self._in_section, self._state = False, "text"
        else:
            self._state = "section" if self._in_section or self.drop_after_section else "text"


class MiniMaxM2ToolParser(InvokeToolParser):
    needs_special_tokens = True  # <minimax:tool_call> is a special token
    section_starts = ("<minimax:tool_call>",)
    section_end = "</minimax:tool_call>"
    invoke = "<invoke name="
    invoke_end = "</invoke>"
    param = "<parameter"
    param_end = "</parameter>"
