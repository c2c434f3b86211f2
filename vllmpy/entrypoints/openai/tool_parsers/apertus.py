"""apertus: Swiss AI's Apertus writes a JSON list of one-key objects, each key a function
name and its value the arguments, between special tokens::

    I will check. <|tools_prefix|>[{"get_weather": {"city": "Paris"}}, {"get_time": {}}]<|tools_suffix|>

Text before the list is content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.marked_json import (
    Block,
    CallReader,
    MarkedJsonToolParser,
    NameKeyedCallReader,
)


class ApertusToolParser(MarkedJsonToolParser):
    needs_special_tokens = True  # the prefix and suffix are special tokens
    blocks = (Block("<|tools_prefix|>", "<|tools_suffix|>"),)

    def make_item(self) -> CallReader:
        return NameKeyedCallReader(self)
