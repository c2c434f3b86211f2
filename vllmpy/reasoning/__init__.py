"""Reasoning parsers: split generated text into reasoning_content and content.

The registry maps each ``--reasoning-parser`` name to its class, imported on first use.
``auto`` picks one from the chat template; ``none`` turns reasoning parsing off.
"""

from __future__ import annotations

import importlib

from vllmpy.reasoning.abstract import ReasoningDelta, ReasoningParser, split_at_marker

_PKG = "vllmpy.reasoning"
# name -> "module:Class"
REASONING_PARSERS: dict[str, str] = {
    "think_auto": f"{_PKG}.think_auto:ThinkAutoReasoningParser",
    "deepseek_r1": f"{_PKG}.deepseek_r1:DeepSeekR1ReasoningParser",
    "deepseek_v3": f"{_PKG}.deepseek_v3:DeepSeekV3ReasoningParser",
    "holo2": f"{_PKG}.holo2:Holo2ReasoningParser",
    "mistral": f"{_PKG}.mistral:MistralReasoningParser",
    "minimax_m2": f"{_PKG}.minimax_m2:MiniMaxM2ReasoningParser",
    "minimax_m2_append_think": f"{_PKG}.minimax_m2:MiniMaxM2AppendThinkReasoningParser",
    "step3": f"{_PKG}.step3:Step3ReasoningParser",
    "olmo3": f"{_PKG}.olmo3:Olmo3ReasoningParser",
    "muse_glimmer": f"{_PKG}.muse_glimmer:MuseGlimmerReasoningParser",
    "qwen3": f"{_PKG}.qwen3:Qwen3ReasoningParser",
    "mimo": f"{_PKG}.qwen3:Qwen3ReasoningParser",
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The class registered as ``name``; an unknown name is refused listing the choices."""
    target = REASONING_PARSERS.get(name)
    if target is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from "
                         f"{', '.join(REASONING_PARSERS)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The parser a chat template calls for, from the markers it writes, or None.

    - Muse Glimmer's ATEM reasoning channel (``to=self<|message|>`` ... ``<|eom|>``) ->
      muse_glimmer;
    - ``[THINK]`` -> mistral;
    - ``<think>`` beside MiniMax-M2's ``<minimax:tool_call>`` -> minimax_m2 (a tool call
      may end its reasoning without ``</think>``);
    - any other ``<think>`` or ``</think>`` -> think_auto: right for hybrid models that
      may answer without a thinking block, and for templates that write the block into
      the prompt (the parser reads the prompt's open or closed block). qwen3 is never
      chosen here, since it takes marker-less output for reasoning.
    """
    if not chat_template:
        return None
    if "to=self<|message|>" in chat_template and "<|eom|>" in chat_template:
        return "muse_glimmer"
    if "[THINK]" in chat_template:
        return "mistral"
    if "<think>" in chat_template and "<minimax:tool_call>" in chat_template:
        return "minimax_m2"
    if "<think>" in chat_template or "</think>" in chat_template:
        return "think_auto"
    return None


__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "detect_reasoning_parser",
           "get_reasoning_parser", "split_at_marker"]
