"""ernie45: ERNIE 4.5 writes each call as a JSON object between tags, and may wrap its
answer in ``<response>`` tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <response>It is sunny.</response>

The response tags are not content; the text between them is.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.marked_json import Block, MarkedJsonToolParser


class Ernie45ToolParser(MarkedJsonToolParser):
    needs_special_tokens = True  # the tags are special tokens in ERNIE's vocabulary
    blocks = (Block("<tool_call>", "</tool_call>", "{"),)
    dropped = ("<response>", "</response>")
