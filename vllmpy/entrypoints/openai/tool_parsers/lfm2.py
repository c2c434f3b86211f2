"""lfm2: Liquid AI's LFM2 / LFM2.5 write a Python list of calls between special tokens::

    Let me check.<|tool_call_start|>[get_weather(city="Paris"), get_time()]<|tool_call_end|>
    The weather in Paris is sunny.

Text before and after the block is content (see ``python_calls`` for the calls).
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.python_calls import PythonCallsToolParser


class Lfm2ToolParser(PythonCallsToolParser):
    needs_special_tokens = True  # the block's markers are special tokens
    start = "<|tool_call_start|>"
    end = "<|tool_call_end|>"
