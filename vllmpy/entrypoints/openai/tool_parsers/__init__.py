"""Tool parsers: read a model's tool calls out of its generated text.

The registry maps each ``--tool-call-parser`` name to its class, imported on first use.
``auto`` picks one from the chat template; ``none`` turns tool parsing off.
"""

from __future__ import annotations

import importlib

from vllmpy.entrypoints.openai.tool_parsers.abstract import (
    ParsedDelta,
    ParsedOutput,
    ToolCallDelta,
    ToolParser,
)

_PKG = "vllmpy.entrypoints.openai.tool_parsers"
# name -> "module:Class"
TOOL_PARSERS: dict[str, str] = {
    "hermes": f"{_PKG}.hermes:HermesToolParser",
    "qwen3_coder": f"{_PKG}.qwen3_coder:Qwen3CoderToolParser",
    "llama3_json": f"{_PKG}.llama3_json:Llama3JsonToolParser",
    "llama4_json": f"{_PKG}.llama3_json:Llama3JsonToolParser",
    "mistral": f"{_PKG}.mistral:MistralToolParser",
    "pythonic": f"{_PKG}.pythonic:PythonicToolParser",
    "llama4_pythonic": f"{_PKG}.pythonic:PythonicToolParser",
    "deepseek_v3": f"{_PKG}.deepseek_v3:DeepSeekV3ToolParser",
    "granite": f"{_PKG}.granite:GraniteToolParser",
    "internlm": f"{_PKG}.internlm:InternLMToolParser",
    # -- group A --
    # -- end of group A --
    # -- group B --
    # -- end of group B --
}

# (parser, what the chat template must contain), checked in order: the most specific
# first, since several formats share tags such as <tool_call>
_SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # -- group A --
    # -- end of group A --
    # -- group B --
    # -- end of group B --
    ("qwen3_coder", ("<tool_call>", "<function=", "<parameter=")),
    ("granite", ("<|start_of_role|>", "<|tool_call|>")),
    ("granite", ("<|start_of_role|>", "<tool_call>")),
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>",)),
    ("internlm", ("<|action_start|>", "<|plugin|>")),
    ("pythonic", ("[func_name1(",)),
    ("llama3_json", ("<|python_tag|>",)),
)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The class registered as ``name``; an unknown name is refused listing the choices."""
    target = TOOL_PARSERS.get(name)
    if target is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from "
                         f"{', '.join(TOOL_PARSERS)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser whose call format a chat template writes, or None."""
    for name, needles in _SIGNATURES:
        if chat_template and all(n in chat_template for n in needles):
            return name
    return None


__all__ = ["TOOL_PARSERS", "ParsedDelta", "ParsedOutput", "ToolCallDelta", "ToolParser",
           "detect_tool_parser", "get_tool_parser"]
