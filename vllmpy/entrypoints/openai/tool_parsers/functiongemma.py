"""functiongemma: FunctionGemma writes Gemma's ``call:NAME{ARGS}`` between its own markers,
strings between ``<escape>`` delimiters::

    <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>

The arguments read as gemma4's do; text around the calls is content. Only the marked form
is a call.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.gemma4 import Gemma4EngineToolParser


class FunctionGemmaToolParser(Gemma4EngineToolParser):
    needs_special_tokens = True  # the markers and <escape> are special tokens
    start = "<start_function_call>"
    ends = ("<end_function_call>",)
    delim = "<escape>"
    bare = False
