"""minimax_m2 and minimax_m2_append_think: MiniMax-M2, whose template writes ``<think>``
into the prompt.

minimax_m2 splits the output: it is reasoning up to ``</think>`` (a ``<think>`` inside it
is dropped), or up to a ``<minimax:tool_call>`` that starts before it (the call stays in
the content for the tool parser); output that reaches neither is all reasoning. In the
content a stray ``</think>`` is dropped, except inside a tool call. A prompt that closed
its thinking block leaves the output all content.

minimax_m2_append_think splits nothing: the whole output is content, with the
``<think>`` the prompt opened written back in front of it, so clients that keep the
thinking in the conversation history see the block whole.
"""

from __future__ import annotations

from vllmpy.reasoning.abstract import ReasoningDelta, ReasoningParser, split_at_marker

TOOL_CALL_START = "<minimax:tool_call>"
TOOL_CALL_END = "</minimax:tool_call>"


class MiniMaxM2ReasoningParser(ReasoningParser):
    content_starts = (TOOL_CALL_START,)
    dropped_in_reasoning = ("<think>",)

    def initial_mode(self, prompt_state: str | None) -> str:
        return "content" if prompt_state == "closed" else "reasoning"

    def _mode_content(self, out: ReasoningDelta, final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, (self.end, TOOL_CALL_START))
        out.content += before
        if marker is None:
            out.content += after if final else ""
            self._buf = "" if final else after
            return False
        if marker == TOOL_CALL_START:
            out.content += marker
            self._mode = "tool_call"
        self._buf = after
        return True

    def _mode_tool_call(self, out: ReasoningDelta, final: bool) -> bool:
        """Inside a tool call everything is content, up to and with its end marker."""
        before, marker, after = split_at_marker(self._buf, (TOOL_CALL_END,))
        out.content += before + (marker or (after if final else ""))
        self._buf = after if marker or not final else ""
        if marker is None:
            return False
        self._mode = "content"
        return True


class MiniMaxM2AppendThinkReasoningParser(ReasoningParser):
    def initial_mode(self, prompt_state: str | None) -> str:
        return "content"

    def push(self, text: str) -> ReasoningDelta:
        return ReasoningDelta(content=self._prefix() + text)

    def finish(self) -> ReasoningDelta:
        return ReasoningDelta(content=self._prefix())

    def _prefix(self) -> str:
        if self._mode == "content":
            self._mode = "prefixed"
            return self.start
        return ""
