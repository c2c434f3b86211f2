"""gigachat3: GigaChat 3 ends its text with ``<|message_sep|>`` and writes a call as a
``function call`` message; GigaChat 3.1 writes ``<|function_call|>`` instead::

    Let me check.<|message_sep|>

    function call<|role_sep|>
    {"name": "get_weather", "arguments": {"city": "Paris"}}

    Let me check.<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}

The separators and a closing ``</s>`` are not content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.marked_json import Block, MarkedJsonToolParser


class GigaChat3ToolParser(MarkedJsonToolParser):
    needs_special_tokens = True  # the separators are special tokens
    blocks = (Block("<|function_call|>", None, "{"),
              Block("function call<|role_sep|>", None, "{"))
    dropped = ("<|message_sep|>", "</s>")
