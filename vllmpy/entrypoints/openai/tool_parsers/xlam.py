"""xlam: Salesforce xLAM writes a JSON list of calls, either as the whole output or inside
a code fence, ``<tool_call>`` tags, after ``[TOOL_CALLS]`` or after ``</think>``::

    [{"name": "get_weather", "arguments": {"city": "Paris"}}]

    Let me check.
    ```json
    [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    ```

A fence or tag whose body is not a list of calls is content, and so is the text around
the calls.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.marked_json import Block, MarkedJsonToolParser


class XLAMToolParser(MarkedJsonToolParser):
    leading = Block("", None)
    blocks = (Block("```", "```", "[", label="json"),
              Block("<tool_call>", "</tool_call>"),
              Block("[TOOL_CALLS]", None),
              Block("</think>", None))
