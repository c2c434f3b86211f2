"""hf: vLLM's parser driven by a checkpoint's ``response_template``, the response-schema
metadata a Hugging Face tokenizer configuration may carry (regular expressions for each
field's open and close, content parsers for the tool calls), applied to the whole chat
from its last assistant anchor.

This server cannot honour it: a tool parser here is built from the request's tools
alone, with neither the tokenizer configuration's ``response_template`` nor the rendered
prompt it needs, so it is refused by name rather than guessed at.
"""

from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers.abstract import ToolParser, Tools


class ResponseTemplateToolParser(ToolParser):
    def __init__(self, tools: Tools = None) -> None:
        raise ValueError(
            "tool-call parser 'hf' reads the checkpoint's response_template (the "
            "response-schema metadata in tokenizer_config.json) and the rendered prompt, "
            "which this server does not give its tool parsers; name the model's own "
            "dialect with --tool-call-parser (or use auto, which reads the chat template)")
