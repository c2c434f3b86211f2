"""holo2: deepseek_v3's parser with thinking on by default, for H Company's Holo2 models.

Thinking is on unless the request's chat_template_kwargs (or the server defaults) set
``thinking`` or ``enable_thinking``; when either is set, thinking is on if either is true.
Thinking on: the output is reasoning (a repeated ``<think>`` dropped) until ``</think>``,
and all reasoning when generation stops before it. Thinking off: all content. A prompt the
template left inside or right after a thinking block decides regardless of the variables.
"""

from __future__ import annotations

from vllmpy.reasoning.deepseek_v3 import DeepSeekV3ReasoningParser


class Holo2ReasoningParser(DeepSeekV3ReasoningParser):
    def thinking(self) -> bool:
        kwargs = self.chat_template_kwargs
        thinking = kwargs.get("thinking")
        enable = kwargs.get("enable_thinking", self.enable_thinking)
        if thinking is None and enable is None:
            return True
        return bool(thinking) or bool(enable)
