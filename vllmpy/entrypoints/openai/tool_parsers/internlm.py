"""internlm: InternLM2 / 2.5 call a plugin between action markers::

    <|action_start|><|plugin|>
    {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>

Text outside the markers is content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.hermes import TaggedJsonToolParser


class InternLMToolParser(TaggedJsonToolParser):
    needs_special_tokens = True  # the action markers are special tokens
    start = "<|action_start|><|plugin|>"
    end = "<|action_end|>"
    args_keys = ("parameters", "arguments")
