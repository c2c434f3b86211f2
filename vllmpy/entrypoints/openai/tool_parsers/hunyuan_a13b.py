"""hunyuan_a13b: Tencent Hunyuan-A13B writes its calls as one JSON array between tags::

    <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]</tool_calls>

Text before the tags is content. A ``助手：`` ("assistant:") that the model repeats from
its chat template at the start of the output is not content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.abstract import Tools
from vllmpy.entrypoints.openai.tool_parsers.hermes import TaggedJsonToolParser

_ROLE_ECHO = "助手："


class HunyuanA13BToolParser(TaggedJsonToolParser):
    start = "<tool_calls>"
    end = "</tool_calls>"
    array = True

    def __init__(self, tools: Tools = None) -> None:
        super().__init__(tools)
        self._head = True  # the start of the output is still to be checked for the echo

    def _parse(self, final: bool) -> None:
        if self._head:
            stripped = self._buf.lstrip()
            if not final and _ROLE_ECHO.startswith(stripped):
                return  # perhaps the echo: wait for it
            if stripped.startswith(_ROLE_ECHO):
                self._buf = stripped[len(_ROLE_ECHO):]
            self._head = False
        super()._parse(final)
