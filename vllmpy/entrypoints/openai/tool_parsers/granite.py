"""granite: IBM Granite 3.x writes its calls as one JSON array, after ``<|tool_call|>``
(3.0) or ``<tool_call>`` (3.1 and later)::

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

The output must start with the array (after the marker); otherwise it is content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.leading import LeadingJsonToolParser


class GraniteToolParser(LeadingJsonToolParser):
    needs_special_tokens = True  # <|tool_call|> is a special token in Granite 3.0
    prefixes = ("<|tool_call|>", "<tool_call>")
    opener = "["
