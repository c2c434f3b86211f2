"""cohere_command3 / cohere_command4: Cohere Command R7B and Command A write a JSON list
of calls between action markers, and their answer between response markers::

    <|START_THINKING|>I will look it up.<|END_THINKING|><|START_ACTION|>[
        {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}
    ]<|END_ACTION|>

    <|START_RESPONSE|>It is sunny.<|END_RESPONSE|>

Command R+ wrote the same list after ``Action:`` in a JSON code fence, which
``cohere_command3`` reads too. Command A's newer templates (``cohere_command4``) mark the answer with ``<|START_TEXT|>``
and ``<|END_TEXT|>`` as well. The markers are not content; a thinking block that reaches
this parser (no reasoning parser took it) is the model's plan, not its answer, and is
dropped. The calls get fresh ids: ``tool_call_id`` only numbers them within the turn.
"""

from __future__ import annotations

from typing import ClassVar

from vllmpy.entrypoints.openai.tool_parsers.marked_json import Block, MarkedJsonToolParser

_RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
_TEXT = ("<|START_TEXT|>", "<|END_TEXT|>")


class CohereCommand3ToolParser(MarkedJsonToolParser):
    needs_special_tokens = True  # every marker is a special token
    blocks = (Block("<|START_ACTION|>", "<|END_ACTION|>"),
              Block("Action:", "```", label="```json"))
    dropped: ClassVar[tuple[str, ...]] = _RESPONSE
    skipped = (("<|START_THINKING|>", "<|END_THINKING|>"),)
    name_keys = ("tool_name",)
    args_keys = ("parameters",)


class CohereCommand4ToolParser(CohereCommand3ToolParser):
    dropped = _RESPONSE + _TEXT
