"""step3: StepFun's Step3. Its template writes ``<think>`` into the prompt, so the output
is reasoning up to the first ``</think>`` and content after it; output without
``</think>`` is all reasoning (generation stopped while thinking). The output is taken as
it comes: a ``<think>`` the model writes itself stays in the reasoning. A prompt that
closed its thinking block leaves the output all content."""

from __future__ import annotations

from vllmpy.reasoning.abstract import ReasoningParser


class Step3ReasoningParser(ReasoningParser):
    def initial_mode(self, prompt_state: str | None) -> str:
        return "content" if prompt_state == "closed" else "reasoning"
