"""think_auto: for hybrid-thinking models that may answer with or without a <think> block.

Reasoning is what a leading ``<think>...</think>`` holds (or, when the chat template opened
the block in the prompt, everything up to ``</think>``); output without the block is all
content.
"""

from __future__ import annotations

from vllmpy.reasoning.abstract import ReasoningParser


class ThinkAutoReasoningParser(ReasoningParser):
    def initial_mode(self, prompt_state: str | None) -> str:
        return "reasoning" if prompt_state == "open" else "head"
