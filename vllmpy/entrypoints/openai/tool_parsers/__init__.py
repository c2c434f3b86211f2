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
    "deepseek_v31": f"{_PKG}.deepseek_v3:DeepSeekV31ToolParser",
    "deepseek_v32": f"{_PKG}.dsml:DeepSeekV32ToolParser",
    "deepseek_v4": f"{_PKG}.dsml:DeepSeekV4ToolParser",
    "deepseek_v41": f"{_PKG}.dsml:DeepSeekV41ToolParser",
    "kimi_k2": f"{_PKG}.kimi_k2:KimiK2ToolParser",
    "kimi_k3": f"{_PKG}.kimi_k3:KimiK3ToolParser",
    "k2_horizon": f"{_PKG}.k2_horizon:K2HorizonToolParser",
    "glm45": f"{_PKG}.glm4:Glm4ToolParser",
    "glm47": f"{_PKG}.glm4:Glm4ToolParser",
    "ling3": f"{_PKG}.glm4:Glm4ToolParser",
    "minimax_m2": f"{_PKG}.minimax_m2:MiniMaxM2ToolParser",
    "minimax_m3": f"{_PKG}.minimax_m3:MiniMaxM3ToolParser",
    "mimo": f"{_PKG}.mimo:MiMoToolParser",
    "qwen3_json": f"{_PKG}.hermes:HermesToolParser",
    "qwen3_xml": f"{_PKG}.qwen3_coder:Qwen3CoderToolParser",
    "seed_oss": f"{_PKG}.seed_oss:SeedOssToolParser",
    "step3": f"{_PKG}.step3:Step3ToolParser",
    "step3p5": f"{_PKG}.qwen3_coder:Qwen3CoderToolParser",
    "longcat": f"{_PKG}.longcat:LongcatToolParser",
    "hunyuan_a13b": f"{_PKG}.hunyuan_a13b:HunyuanA13BToolParser",
    "hy_v3": f"{_PKG}.hunyuan:HyV3ToolParser",
    "hy_v4": f"{_PKG}.hunyuan:HyV4ToolParser",
    # -- end of group A --
    # -- group B --
    "apertus": f"{_PKG}.apertus:ApertusToolParser",
    "cohere_command3": f"{_PKG}.cohere:CohereCommand3ToolParser",
    "cohere_command4": f"{_PKG}.cohere:CohereCommand4ToolParser",
    "ernie45": f"{_PKG}.ernie45:Ernie45ToolParser",
    "gigachat3": f"{_PKG}.gigachat3:GigaChat3ToolParser",
    "granite-20b-fc": f"{_PKG}.granite_20b_fc:Granite20bFCToolParser",
    "granite4": f"{_PKG}.granite4:Granite4ToolParser",
    "jamba": f"{_PKG}.jamba:JambaToolParser",
    "phi4_mini_json": f"{_PKG}.phi4_mini:Phi4MiniJsonToolParser",
    "xlam": f"{_PKG}.xlam:XLAMToolParser",
    "dots": f"{_PKG}.dots:DotsToolParser",
    "minicpm5": f"{_PKG}.minicpm5:MiniCPM5XMLToolParser",
    "poolside_v1": f"{_PKG}.poolside:PoolsideV1ToolParser",
    "lfm2": f"{_PKG}.lfm2:Lfm2ToolParser",
    "olmo3": f"{_PKG}.olmo3:Olmo3PythonicToolParser",
    "plamo3": f"{_PKG}.plamo3:Plamo3EngineToolParser",
    "inkling": f"{_PKG}.inkling:InklingEngineToolParser",
    "gemma4": f"{_PKG}.gemma4:Gemma4EngineToolParser",
    "functiongemma": f"{_PKG}.functiongemma:FunctionGemmaToolParser",
    "openai": f"{_PKG}.gpt_oss:GptOssToolParser",
    "muse_glimmer": f"{_PKG}.muse_glimmer:MuseGlimmerToolParser",
    "hf": f"{_PKG}.hf_response_template:ResponseTemplateToolParser",
    # -- end of group B --
}

# (parser, what the chat template must contain), checked in order: the most specific
# first, since several formats share tags such as <tool_call>
_SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # -- group A --
    ("deepseek_v41", ("｜DSML｜", " calls>")),
    ("deepseek_v41", ("｜DSML｜ ", "calls>")),
    ("deepseek_v32", ("｜DSML｜", "function_calls>")),
    ("deepseek_v4", ("｜DSML｜", "tool_calls>")),
    ("deepseek_v31", ("<｜tool▁calls▁begin｜>", "['name'] + '<｜tool▁sep｜>'")),
    ("step3", ("<｜tool_calls_begin｜>",)),
    ("step3", ("<steptml:invoke",)),
    ("kimi_k3", ("<|open|>", "<|close|>", "<|sep|>")),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("k2_horizon", ("<ifm|tool_call>",)),
    ("minimax_m3", ("]<]minimax[>[", "<invoke name=")),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("seed_oss", ("<seed:tool_call>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("hy_v3", ("<tool_calls", "<tool_sep", "<arg_key")),
    ("ling3", ("<|role_end|>", "<tool_call>", "<arg_key>")),
    ("glm47", ("[gMASK]<sop>", "<tool_call>{function-name}<arg_key>")),
    ("glm45", ("[gMASK]<sop>", "<tool_call>", "<arg_key>")),
    # -- end of group A --
    # -- group B --
    ("apertus", ("<|tools_prefix|>",)),
    ("cohere_command4", ("<|START_ACTION|>", "<|START_TEXT|>")),
    ("cohere_command3", ("<|START_ACTION|>",)),
    ("cohere_command3", ("<|START_OF_TURN_TOKEN|>", "Action:", "```json")),
    ("gigachat3", ("<|role_sep|>",)),
    ("lfm2", ("<|tool_call_start|>",)),
    ("lfm2", ("<|tool_list_start|>",)),
    ("lfm2", ("<|im_start|>", "List of tools: [")),
    ("minicpm5", ('<function name="', '<param name="')),
    ("poolside_v1", ("<arg_key>", "〈|EOS|〉")),
    ("muse_glimmer", ("<atem:invoke",)),
    ("openai", ("<|start|>assistant", "<|channel|>")),
    ("gemma4", ("<|tool_call>call:",)),
    ("functiongemma", ("<start_function_call>",)),
    ("granite4", ("<|start_of_role|>", "</tool_call>")),
    ("phi4_mini_json", ("functools[",)),
    ("dots", ("<dots_function_call>",)),
    ("plamo3", ("<|plamo:begin_tool_requests:plamo|>",)),
    ("inkling", ("<|content_invoke_tool_json|>",)),
    ("olmo3", ("<function_calls>", "</function_calls>")),
    # -- end of group B --
    # GLM's key/value calls, written by other families' templates too (Spark-X2.5)
    ("glm45", ("<tool_call>", "<arg_key>", "<arg_value>")),
    # a JSON array of calls in <tool_calls> (Jamba's form; Apriel writes it too)
    ("jamba", ("<tool_calls>[",)),
    ("qwen3_coder", ("<tool_call>", "<function=", "<parameter=")),
    ("granite", ("<|start_of_role|>", "<|tool_call|>")),
    ("granite", ("<|start_of_role|>", "<tool_call>")),
    ("hermes", ("<tool_call>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("deepseek_v3", ("<｜tool▁calls▁begin｜>",)),
    ("internlm", ("<|action_start|>", "<|plugin|>")),
    ("pythonic", ("[func_name1(",)),
    ("llama3_json", ('{"name": function name, "parameters": dictionary',)),
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
