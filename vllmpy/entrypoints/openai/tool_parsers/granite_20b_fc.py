"""granite-20b-fc: granite-20b-functioncalling writes each call as a JSON object after
``<function_call>``, with no closing marker::

    Let me check. <function_call> {"name": "get_weather", "arguments": {"city": "Paris"}}
    <function_call> {"name": "get_time", "arguments": {}}

Text before the first call is content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.marked_json import Block, MarkedJsonToolParser


class Granite20bFCToolParser(MarkedJsonToolParser):
    blocks = (Block("<function_call>", None, "{"),)
