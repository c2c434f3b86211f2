"""step3: StepFun Step-3 writes steptml invoke elements inside DeepSeek-like markers::

    <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>
    <steptml:invoke name="get_weather">
    <steptml:parameter name="city">Paris</steptml:parameter>
    </steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>

Values are typed from the tool schema, whitespace around them dropped. Text before and
after the calls is content.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.minimax_m2 import InvokeToolParser


class Step3ToolParser(InvokeToolParser):
    needs_special_tokens = True  # the ｜-markers are special tokens
    section_starts = ("<｜tool_calls_begin｜>",)
    section_end = "<｜tool_calls_end｜>"
    invoke, invoke_end = "<steptml:invoke name=", "</steptml:invoke>"
    param, param_end = "<steptml:parameter", "</steptml:parameter>"
    bare_invoke = False
    strip_values = True
