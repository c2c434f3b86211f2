"""hy_v3, hy_v4: Tencent Hy3 / Hy4 write key / value calls (glm4's shape) inside a
section, every marker carrying the checkpoint's suffix (``:opensource`` in Hy3's chat
template; empty in some checkpoints)::

    <tool_calls:opensource>
    <tool_call:opensource>get_weather<tool_sep:opensource>
    <arg_key:opensource>city</arg_key:opensource>
    <arg_value:opensource>Paris</arg_value:opensource>
    </tool_call:opensource>
    </tool_calls:opensource>

Hy3 ends the name with ``<tool_sep>``; Hy4 has no separator (the name runs up to the first
argument). The suffix is read from the section's opening marker, so it need not be known
in advance. Values are typed from the tool schema. Text before the section is content; a
call ends the turn, so text after it is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from vllmpy.entrypoints.openai.tool_parsers.glm4 import KeyValueToolParser

_SECTION = "<tool_calls"  # then the suffix and '>'
_SUFFIX = re.compile(r"(?::[^\s<>:]{1,64})?")


class _HunyuanToolParser(KeyValueToolParser):
    needs_special_tokens = True  # the markers are special tokens
    drop_after_section = True
    separator = False  # the name ends with <tool_sep>

    def steps(self) -> dict[str, Callable[[bool], bool]]:
        return {**super().steps(), "suffix": self._suffix}

    def _text(self, final: bool) -> bool:
        if self.section_start:  # the suffix is known
            return super()._text(final)
        if self.scan_content((_SECTION,), final) is None:
            return False
        self._state = "suffix"
        return True

    def _suffix(self, final: bool) -> bool:
        at = self._buf.find(">")
        if at < 0 and not final and len(self._buf) <= 66:
            return False
        suffix = self._buf[:at] if at >= 0 else None
        if suffix is None or not _SUFFIX.fullmatch(suffix):
            self.emit_content(_SECTION)  # not the section's marker: content
            self._state = "text"
            return True
        self._buf = self._buf[at + 1:]
        self._use_suffix(suffix)
        self._in_section, self._state = True, "section"
        return True

    def _use_suffix(self, suffix: str) -> None:
        def tag(name: str) -> tuple[str, str]:
            return f"<{name}{suffix}>", f"</{name}{suffix}>"

        self.section_start, self.section_end = tag("tool_calls")
        self.call_start, self.call_end = tag("tool_call")
        self.key_start, self.key_end = tag("arg_key")
        self.value_start, self.value_end = tag("arg_value")
        self.name_ends = (f"<tool_sep{suffix}>",) if self.separator else ()


class HyV3ToolParser(_HunyuanToolParser):
    separator = True


class HyV4ToolParser(_HunyuanToolParser):
    separator = False
