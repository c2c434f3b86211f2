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
    "qwen3": f"{_PKG}.qwen3:Qwen3ReasoningParser",
    "mimo": f"{_PKG}.qwen3:Qwen3ReasoningParser",
    "mistral": f"{_PKG}.mistral:MistralReasoningParser",
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
    """The parser a chat template calls for: ``[THINK]`` -> mistral, ``<think>`` ->
    think_auto (right for hybrid models that may answer without a thinking block; qwen3 is
    never chosen here), otherwise None."""
    if not chat_template:
        return None
    if "[THINK]" in chat_template:
        return "mistral"
    if "<think>" in chat_template:
        return "think_auto"
    return None


__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "detect_reasoning_parser",
           "get_reasoning_parser", "split_at_marker"]
