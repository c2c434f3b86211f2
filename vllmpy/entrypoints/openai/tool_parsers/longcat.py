"""longcat: Meituan LongCat-Flash writes hermes' JSON call objects between its own tags::

    <longcat_tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </longcat_tool_call>
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.hermes import TaggedJsonToolParser


class LongcatToolParser(TaggedJsonToolParser):
    needs_special_tokens = True  # the tags are special tokens
    start = "<longcat_tool_call>"
    end = "</longcat_tool_call>"
