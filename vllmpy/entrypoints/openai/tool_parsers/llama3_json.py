"""llama3_json: Llama 3.1 / 3.2 / 4 JSON calls, optionally after ``<|python_tag|>``, several
separated by ``;``::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The output must start with the call (``parameters`` or ``arguments`` hold the arguments);
otherwise it is content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.leading import LeadingJsonToolParser


class Llama3JsonToolParser(LeadingJsonToolParser):
    needs_special_tokens = True  # <|python_tag|> is a special token
    prefixes = ("<|python_tag|>",)
    opener = "{"
    separator = ";"
    args_keys = ("parameters", "arguments")
