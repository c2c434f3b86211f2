"""jamba: AI21 Jamba 1.5 / 1.6 write their calls as one JSON array between tags::

    Let me check.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>

Text before the tags is content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.marked_json import Block, MarkedJsonToolParser


class JambaToolParser(MarkedJsonToolParser):
    needs_special_tokens = True  # <tool_calls> and </tool_calls> are special tokens
    blocks = (Block("<tool_calls>", "</tool_calls>"),)
