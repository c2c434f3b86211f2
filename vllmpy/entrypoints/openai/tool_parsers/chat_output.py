"""From a chat request and the generated text to the assistant message: reasoning, content
and tool calls, whole or as stream deltas.

``plan_chat_output`` decides, per request, what the output is parsed with:

- the reasoning parser (``--reasoning-parser``) splits off ``reasoning_content`` first;
- ``tool_choice`` "auto" (the default when ``tools`` are given) runs the tool-call parser
  (``--tool-call-parser``) over the content after the reasoning;
- "required" and a named function are enforced with structured output (``json_schema``)
  and read back by the forced parsers; reasoning is not parsed then, since the constraint
  holds from the first token;
- "none", or no tools, leaves the content alone.

A call's ``finish_reason`` is ``tool_calls`` when it made tool calls and stopped on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from vllmpy.entrypoints.openai.serving_common import ServerContext
from vllmpy.entrypoints.openai.tool_parsers import get_tool_parser
from vllmpy.entrypoints.openai.tool_parsers.abstract import (
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    collect,
)
from vllmpy.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    named_schema,
    required_schema,
)
from vllmpy.reasoning import ReasoningParser, get_reasoning_parser
from vllmpy.sampling_params import SamplingParams
from vllmpy.structured_output import StructuredOutputsParams, validate_structured_outputs


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


class ChoiceParser:
    """Parses one choice: reasoning first, then tool calls in the content after it."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def push(self, text: str) -> ChoiceDelta:
        return self._step(text, final=False)

    def finish(self) -> ChoiceDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ChoiceDelta:
        out = ChoiceDelta()
        content = text
        if self.reasoning is not None:
            part = self.reasoning.finish() if final else self.reasoning.push(text)
            out.reasoning = part.reasoning
            if self.tools is None or not self.tools.reads_messages:
                content = part.content
        if self.tools is None:
            out.content = content
            return out
        pieces = [self.tools.push(content)] if content else []
        if final:
            pieces.append(self.tools.finish())
        for piece in pieces:
            out.content += piece.content
            out.tool_calls.extend(piece.tool_calls)
        return out

    def parse(self, text: str) -> ChatMessage:
        """A whole response's message."""
        deltas = [self.push(text), self.finish()]
        reasoning = "".join(d.reasoning for d in deltas)
        whole = collect([ParsedDelta(d.content, d.tool_calls) for d in deltas])
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in whole.tool_calls]
        content = whole.content
        if content is None and not calls and not reasoning:
            content = ""
        return ChatMessage(content=content, reasoning_content=reasoning or None,
                           tool_calls=calls)


def delta_message(delta: ChoiceDelta) -> DeltaMessage:
    """A stream chunk's delta: a call's id, type and name only on its first delta."""
    calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                           function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
             for c in delta.tool_calls]
    return DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None,
                        tool_calls=calls)


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and reason == "stop" else reason


@dataclass
class ChatOutputPlan:
    """How one request's output is parsed, and what it asks of sampling."""

    make_reasoning: Callable[[], ReasoningParser] | None = None
    make_tools: Callable[[], ToolParser] | None = None
    needs_special_tokens: bool = False
    json_schema: dict[str, Any] | None = None  # structured output the tool choice needs

    def choice_parser(self) -> ChoiceParser | None:
        if self.make_reasoning is None and self.make_tools is None:
            return None
        return ChoiceParser(self.make_reasoning() if self.make_reasoning else None,
                            self.make_tools() if self.make_tools else None)

    def apply(self, params: SamplingParams) -> None:
        """What the parse asks of sampling: special tokens kept where the markers are
        special tokens, and the tool choice's structured output (a 400 when the request
        constrains its output otherwise, or a tool schema cannot be enforced)."""
        if self.needs_special_tokens:
            params.skip_special_tokens = False
        if self.json_schema is None:
            return
        if params.structured_outputs is not None:
            raise OpenAIError(400, "tool_choice 'required' or a named function constrains the "
                              "output to tool calls itself, so it cannot be combined with "
                              "response_format or structured_outputs", param="tool_choice")
        constraint = StructuredOutputsParams(json=self.json_schema)
        try:
            validate_structured_outputs(constraint)
        except ValueError as e:
            raise OpenAIError(400, f"the tool_choice needs the tools' parameter schemas "
                              f"enforced, and they cannot be: {e}", param="tools") from None
        params.structured_outputs = constraint

    def message(self, text: str, reason: str | None) -> tuple[ChatMessage, str | None]:
        """A whole response's message for one choice, and its finish_reason."""
        parser = self.choice_parser()
        if parser is None:
            return ChatMessage(role="assistant", content=text), reason
        message = parser.parse(text)
        return message, finish_reason(reason, parser.called_tools)


def tool_choice_of(req: ChatCompletionRequest) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function)."""
    choice = req.tool_choice
    if not req.tools:
        return "none", None
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        return choice, None
    return "named", choice.function.name


def plan_chat_output(req: ChatCompletionRequest, *, tool_parser: str | None,
                     reasoning_parser: str | None, template_kwargs: dict[str, Any],
                     prompt_tail: str) -> ChatOutputPlan:
    """The plan for ``req`` under the server's parsers; a tool choice the server cannot
    honour is a 400."""
    choice, name = tool_choice_of(req)
    tools: Sequence[dict[str, Any]] = req.template_tools() or []
    plan = ChatOutputPlan()
    if choice == "auto":
        if tool_parser is None:
            raise OpenAIError(400, "tool_choice 'auto' needs a tool-call parser, and this "
                              "server runs with --tool-call-parser none; send tool_choice "
                              "'none', 'required' or a named function", param="tool_choice")
        cls = get_tool_parser(tool_parser)
        plan.make_tools = partial(cls, tools)
        plan.needs_special_tokens = cls.needs_special_tokens
    elif choice == "required":
        plan.make_tools = partial(RequiredToolParser, tools)
        plan.json_schema = required_schema(tools)
    elif choice == "named":
        assert name is not None
        plan.make_tools = partial(NamedToolParser, tools, name=name)
        plan.json_schema = named_schema(tools, name)
    if reasoning_parser is not None and plan.json_schema is None:
        rcls = get_reasoning_parser(reasoning_parser)
        enable = template_kwargs.get("enable_thinking")
        plan.make_reasoning = partial(
            rcls, prompt_tail=prompt_tail,
            enable_thinking=enable if isinstance(enable, bool) else None,
            chat_template_kwargs=template_kwargs)
        plan.needs_special_tokens = plan.needs_special_tokens or rcls.needs_special_tokens
    return plan


class ChoiceStreams:
    """The parsers of a streamed response's choices, by choice index."""

    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.parsers: dict[int, ChoiceParser | None] = {}

    def delta(self, index: int, text: str, finished: bool) -> DeltaMessage | None:
        """The delta for a choice's new text (None when there is nothing to send)."""
        if index not in self.parsers:
            self.parsers[index] = self.plan.choice_parser()
        parser = self.parsers[index]
        if parser is None:
            return DeltaMessage(content=text) if text else None
        parsed = parser.push(text) if text else ChoiceDelta()
        if finished:
            tail = parser.finish()
            parsed.reasoning += tail.reasoning
            parsed.content += tail.content
            parsed.tool_calls.extend(tail.tool_calls)
        return None if parsed.empty() else delta_message(parsed)

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        parser = self.parsers.get(index)
        return finish_reason(reason, parser is not None and parser.called_tools)


def plan_for(ctx: ServerContext, req: ChatCompletionRequest, ids: list[int]) -> ChatOutputPlan:
    """``plan_chat_output`` under this server's parsers, template defaults and the rendered
    prompt's last tokens (whether the template opened or closed a thinking block)."""
    tokenizer = ctx.engine.tokenizer
    tail = tokenizer.decode(ids[-16:], skip_special_tokens=False) if tokenizer and ids else ""
    return plan_chat_output(
        req, tool_parser=ctx.tool_parser, reasoning_parser=ctx.reasoning_parser,
        template_kwargs={**ctx.default_chat_template_kwargs, **(req.chat_template_kwargs or {})},
        prompt_tail=tail)
