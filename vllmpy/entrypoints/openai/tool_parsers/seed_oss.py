"""seed_oss: ByteDance Seed-OSS writes Qwen3-Coder's XML calls between its own tags::

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    <parameter=days>3</parameter>
    </function>
    </seed:tool_call>

Its chat template writes a non-string value with Python's ``str`` (``True``, ``{'a': 1}``);
values are typed from the tool schema as qwen3_coder types them, Python literals included.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser


class SeedOssToolParser(Qwen3CoderToolParser):
    needs_special_tokens = True  # <seed:tool_call> is a special token
    call_start, call_end = "<seed:tool_call>", "</seed:tool_call>"
