"""mistral: Magistral's ``[THINK]...[/THINK]`` block at the start of the output (or opened by
the prompt). The markers are special tokens, so the request keeps special tokens when
detokenizing. Output without ``[THINK]`` is all content."""

from __future__ import annotations

from vllmpy.reasoning.abstract import ReasoningParser


class MistralReasoningParser(ReasoningParser):
    start = "[THINK]"
    end = "[/THINK]"
    needs_special_tokens = True

    def initial_mode(self, prompt_state: str | None) -> str:
        return "reasoning" if prompt_state == "open" else "head"
