"""mimo: Xiaomi MiMo writes Qwen3-Coder's XML calls with compact parameters::

    <tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    </function>
    </tool_call>

Unlike qwen3_coder, a value is kept verbatim: no newline around it is markup.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser


class MiMoToolParser(Qwen3CoderToolParser):
    trim_newlines = False
