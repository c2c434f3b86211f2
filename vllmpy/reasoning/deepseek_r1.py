"""deepseek_r1: DeepSeek-R1 always thinks first, and its template usually writes the opening
``<think>`` into the prompt, so the output starts inside the thinking block (a repeated
``<think>`` is dropped) and ``</think>`` ends it. Output without ``</think>`` is all
reasoning (generation stopped while thinking)."""

from __future__ import annotations

from vllmpy.reasoning.abstract import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    def initial_mode(self, prompt_state: str | None) -> str:
        return "content" if prompt_state == "closed" else "reasoning_head"
