"""qwen3 (and its alias mimo): thinking is on by default, so output without markers is
reasoning; ``</think>`` ends it, and so does ``<tool_call>`` (which stays in the content for
the tool parser). With ``enable_thinking`` false (the chat_template_kwargs of the request
or ``--no-enable-thinking``), or when the template closed an empty thinking block in the
prompt, the output is all content."""

from __future__ import annotations

from vllmpy.reasoning.abstract import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    content_starts = ("<tool_call>",)

    def initial_mode(self, prompt_state: str | None) -> str:
        if self.enable_thinking is False or prompt_state == "closed":
            return "content"
        return "reasoning_head"
