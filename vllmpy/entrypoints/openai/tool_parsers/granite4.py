"""granite4: IBM Granite 4.0 / 4.1 write each call as a JSON object between tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Unlike Granite 3.x (``granite``, one array after the marker), every call has its own tags,
and text before, between and after them is content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.marked_json import Block, MarkedJsonToolParser


class Granite4ToolParser(MarkedJsonToolParser):
    needs_special_tokens = True  # the tags are special tokens in some Granite 4 vocabularies
    blocks = (Block("<tool_call>", "</tool_call>", "{"),)
