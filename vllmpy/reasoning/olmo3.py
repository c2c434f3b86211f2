"""olmo3: Ai2's Olmo 3 Think models, whose ``<think>`` and ``</think>`` are ordinary text.

The reasoning is what comes before the first ``</think>``, whether or not the output
opened with ``<think>`` (some templates write it into the prompt); the content is what
follows. Output that never reaches ``</think>`` is content, unless a thinking block was
open (the prompt or a leading ``<think>`` opened it): then it is reasoning cut short. A
prompt that closed its thinking block leaves the output all content.

Streaming: output that opened no block is held back until ``</think>`` arrives or the
output ends, since until then it cannot be told whether it was reasoning or the answer.
"""

from __future__ import annotations

from vllmpy.reasoning.abstract import ReasoningDelta, ReasoningParser, split_at_marker


class Olmo3ReasoningParser(ReasoningParser):
    head_fallback = "undecided"

    def initial_mode(self, prompt_state: str | None) -> str:
        if prompt_state == "open":
            return "reasoning"
        return "content" if prompt_state == "closed" else "head"

    def _mode_undecided(self, out: ReasoningDelta, final: bool) -> bool:
        """No block opened: reasoning if ``</think>`` comes, content if the output ends."""
        before, marker, after = split_at_marker(self._buf, (self.end,))
        if marker is not None:
            out.reasoning += before
            self._buf = after
            self._mode = "after"
            return True
        if final:
            out.content += self._buf
            self._buf = ""
        return False
