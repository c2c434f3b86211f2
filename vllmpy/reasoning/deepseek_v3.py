"""deepseek_v3: DeepSeek-V3.1-style hybrid thinking, switched by the chat-template variable
``thinking`` (or ``enable_thinking``). Thinking on: as deepseek_r1. Thinking off (the
default): all content. A prompt the template left inside or right after a thinking block
decides regardless of the variables."""

from __future__ import annotations

from vllmpy.reasoning.abstract import ReasoningParser


class DeepSeekV3ReasoningParser(ReasoningParser):
    def initial_mode(self, prompt_state: str | None) -> str:
        if prompt_state == "open":
            return "reasoning_head"
        if prompt_state == "closed":
            return "content"
        return "reasoning_head" if self.thinking() else "content"

    def thinking(self) -> bool:
        """Whether the request turned thinking on."""
        return bool(self.chat_template_kwargs.get("thinking", self.enable_thinking))
