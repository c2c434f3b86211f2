"""phi4_mini_json: Phi-4-mini (and Firefunction v2, whose template writes the same) put a
JSON list of calls after the word ``functools``, with no closing marker::

    I will check. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]

``parameters`` is read like ``arguments``. Text before the marker is content; a
``functools`` not followed by a list of calls is content too.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.marked_json import Block, MarkedJsonToolParser


class Phi4MiniJsonToolParser(MarkedJsonToolParser):
    blocks = (Block("functools", None),)
