"""deepseek_v32, deepseek_v4, deepseek_v41: DeepSeek's DSML calls, invoke elements whose
parameters say whether their value is a string::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` keeps the value as it is; ``string="false"`` (or no ``string``) reads it
as JSON, and as text when it is not JSON. DeepSeek-V3.2 names the section
``function_calls``; V4 ``tool_calls`` (``toolcalls`` and ``tool`` are read too); V4.1
puts a space after ``｜DSML｜`` and names it ``calls``. A call ends the turn: text after the
calls is dropped. An invoke without the section around it is a call too.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllmpy.entrypoints.openai.tool_parsers.minimax_m2 import InvokeToolParser


class _DsmlToolParser(InvokeToolParser):
    needs_special_tokens = True  # the DSML markers are added tokens of the vocabulary
    drop_after_section = True

    def value_kind(self, attributes: dict[str, str]) -> str | Sequence[str]:
        return "string" if attributes.get("string") == "true" else "json"


class DeepSeekV32ToolParser(_DsmlToolParser):
    section_starts: tuple[str, ...] = ("<｜DSML｜function_calls>",)
    section_end = "</｜DSML｜function_calls>"
    invoke, invoke_end = "<｜DSML｜invoke name=", "</｜DSML｜invoke>"
    param, param_end = "<｜DSML｜parameter", "</｜DSML｜parameter>"


class DeepSeekV4ToolParser(DeepSeekV32ToolParser):
    section_starts = ("<｜DSML｜tool_calls>", "<｜DSML｜toolcalls>", "<｜DSML｜tool>")
    section_end = "</｜DSML｜tool_calls>"


class DeepSeekV41ToolParser(_DsmlToolParser):
    section_starts = ("<｜DSML｜ calls>",)
    section_end = "</｜DSML｜ calls>"
    invoke, invoke_end = "<｜DSML｜ invoke name=", "</｜DSML｜ invoke>"
    param, param_end = "<｜DSML｜ parameter", "</｜DSML｜ parameter>"
