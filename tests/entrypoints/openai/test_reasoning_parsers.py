"""Reasoning parsers, and the whole chat output pipeline: reasoning first, then tool calls
on the content after it, then the message / stream deltas and the tool-choice plan.

Vectors are hand-written from each family's format and replayed as streams cut every way.
"""

from __future__ import annotations

import json
import random

import pytest

from vllmpy.entrypoints.openai.cli_args import parse_server_args, resolve_output_parsers
from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.protocol import ChatCompletionRequest
from vllmpy.entrypoints.openai.tool_parsers.chat_output import (
    ChoiceStreams,
    plan_chat_output,
)
from vllmpy.reasoning import REASONING_PARSERS, detect_reasoning_parser, get_reasoning_parser
from vllmpy.sampling_params import SamplingParams
from vllmpy.tokenizer.chat_template import normalize_messages

OPENED = "<|im_start|>assistant\n<think>\n"  # a prompt whose template opened the block
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # one that closed an empty block

# (parser, constructor keywords, model text, expected reasoning, expected content)
VECTORS = [
    ("think_auto", {}, "<think>\nLet me add.\n</think>\n\nThe answer is 4.",
     "\nLet me add.\n", "The answer is 4."),
    ("think_auto", {}, "The answer is 4.", "", "The answer is 4."),
    ("think_auto", {}, "Tags like <think> mid-answer are text.", "",
     "Tags like <think> mid-answer are text."),
    ("think_auto", {"prompt_tail": OPENED}, "Adding 2 and 2.</think>4", "Adding 2 and 2.", "4"),
    ("think_auto", {}, "  <think>cut short", "cut short", ""),
    ("deepseek_r1", {}, "I should add.\n</think>\n\n4", "I should add.\n", "4"),
    ("deepseek_r1", {}, "<think>x</think>y", "x", "y"),
    ("deepseek_r1", {}, "still thinking when it stopped", "still thinking when it stopped", ""),
    ("deepseek_r1", {"prompt_tail": CLOSED}, "Direct answer.", "", "Direct answer."),
    ("qwen3", {}, "<think>\nHmm.\n</think>\n\nHi!", "\nHmm.\n", "Hi!"),
    ("qwen3", {}, "Marker-less output is reasoning", "Marker-less output is reasoning", ""),
    ("qwen3", {}, "I need the weather.\n<tool_call>\n{}\n</tool_call>",
     "I need the weather.\n", "<tool_call>\n{}\n</tool_call>"),
    ("qwen3", {"enable_thinking": False}, "Hi! <think>no</think>", "",
     "Hi! <think>no</think>"),
    ("qwen3", {"prompt_tail": CLOSED}, "Hi!", "", "Hi!"),
    ("mimo", {}, "a</think>b", "a", "b"),
    ("mistral", {}, "[THINK]Let me see.[/THINK]The answer.", "Let me see.", "The answer."),
    ("mistral", {}, "Plain answer.", "", "Plain answer."),
    ("mistral", {"prompt_tail": "[INST]q[/INST][THINK]"}, "a[/THINK]b", "a", "b"),
    ("deepseek_v3", {}, "Plain.</think>", "", "Plain.</think>"),
    ("deepseek_v3", {"chat_template_kwargs": {"thinking": True}}, "hm</think>ok", "hm", "ok"),
    ("deepseek_v3", {"prompt_tail": "<｜Assistant｜><think>"}, "hm</think>ok", "hm", "ok"),
]


def cut_sets(text: str) -> list[list[int]]:
    rng = random.Random(len(text))
    sets = [list(range(1, len(text)))] + [[i] for i in range(1, len(text))]
    for _ in range(20):
        sets.append(sorted(rng.sample(range(1, len(text)),
                                      min(len(text) - 1, rng.randint(1, 10)))))
    return sets


def run(parser, text, cuts):
    reasoning = content = ""
    last = 0
    for cut in [*cuts, len(text)]:
        d = parser.push(text[last:cut])
        reasoning, content, last = reasoning + d.reasoning, content + d.content, cut
    d = parser.finish()
    return reasoning + d.reasoning, content + d.content


@pytest.mark.parametrize("name, kwargs, text, reasoning, content", VECTORS,
                         ids=[f"{v[0]}-{i}" for i, v in enumerate(VECTORS)])
def test_vectors_whole_and_streamed(name, kwargs, text, reasoning, content):
    cls = get_reasoning_parser(name)
    assert run(cls(**kwargs), text, []) == (reasoning, content)
    for cuts in cut_sets(text):
        assert run(cls(**kwargs), text, cuts) == (reasoning, content), cuts


def test_every_registered_parser_has_vectors():
    assert set(REASONING_PARSERS) == {v[0] for v in VECTORS}


def test_unknown_reasoning_parser_lists_the_choices():
    with pytest.raises(ValueError, match="think_auto, deepseek_r1"):
        get_reasoning_parser("o1")


@pytest.mark.parametrize("template, expected", [
    ("{% if enable_thinking %}<think>{% endif %}", "think_auto"),
    ("{{ '[THINK]' + thinking + '[/THINK]' }}", "mistral"),
    ("{{ messages }}", None),
])
def test_auto_detection(template, expected, capsys):
    assert detect_reasoning_parser(template) == expected
    args = parse_server_args(["--reasoning-parser", "auto"])
    assert resolve_output_parsers(args, template)[1] == expected
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("server: --reasoning-parser auto: ")


# ---------------------------------------------------------------------------------------
# The pipeline: plan, message, stream
# ---------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def request(**fields):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "weather in Paris?"}], **fields})


def plan(req, tool_parser="hermes", reasoning_parser=None, template_kwargs=None, tail=""):
    return plan_chat_output(req, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                            template_kwargs=template_kwargs or {}, prompt_tail=tail)


QWEN3_TOOL = ('Paris weather needed.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris"}}\n</tool_call>')


def test_reasoning_then_tool_calls_whole_and_streamed():
    p = plan(request(tools=TOOLS), "hermes", "qwen3")
    message, reason = p.message(QWEN3_TOOL, "stop")
    assert message.reasoning_content == "Paris weather needed.\n"
    assert message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Paris"})]
    assert reason == "tool_calls"
    for cuts in cut_sets(QWEN3_TOOL)[::7]:
        streams = ChoiceStreams(p)
        reasoning, calls, last = "", {}, 0
        pieces = [QWEN3_TOOL[a:b] for a, b in zip([0, *cuts], [*cuts, len(QWEN3_TOOL)])]
        for i, piece in enumerate(pieces):
            delta = streams.delta(0, piece, i == len(pieces) - 1)
            if delta is None:
                continue
            reasoning += delta.reasoning_content or ""
            assert delta.content is None
            for call in delta.tool_calls:
                assert call.index >= last
                last = call.index
                if call.id is not None:
                    assert call.index not in calls and call.function.name == "get_weather"
                    assert call.type == "function"
                    calls[call.index] = ""
                calls[call.index] += call.function.arguments or ""
        assert reasoning == message.reasoning_content
        assert calls == {0: message.tool_calls[0].function.arguments}
        assert streams.finish_reason(0, "stop") == "tool_calls"
        assert streams.finish_reason(0, "length") == "length"


def test_no_tools_or_tool_choice_none_leaves_content_alone():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    for req in (request(), request(tools=TOOLS, tool_choice="none")):
        p = plan(req)
        assert p.choice_parser() is None
        message, reason = p.message(text, "stop")
        assert (message.content, message.tool_calls, reason) == (text, [], "stop")


def test_thinking_follows_the_template_kwargs():
    # the server default (--no-enable-thinking) or the request's chat_template_kwargs
    off = plan(request(), None, "qwen3", template_kwargs={"enable_thinking": False})
    assert off.message("Hi", "stop")[0].content == "Hi"
    on = plan(request(), None, "qwen3", template_kwargs={"enable_thinking": True})
    message = on.message("Hmm</think>Hi", "stop")[0]
    assert (message.reasoning_content, message.content) == ("Hmm", "Hi")


def test_auto_needs_a_parser():
    with pytest.raises(OpenAIError) as e:
        plan(request(tools=TOOLS), tool_parser=None)
    assert e.value.status_code == 400 and e.value.param == "tool_choice"
    assert "--tool-call-parser none" in e.value.message


def test_forced_choices_use_structured_output_and_skip_reasoning():
    named = plan(request(tools=TOOLS, tool_choice={"type": "function",
                                                   "function": {"name": "get_weather"}}),
                 reasoning_parser="qwen3")
    assert named.json_schema == TOOLS[0]["function"]["parameters"]
    assert named.make_reasoning is None
    params = SamplingParams()
    named.apply(params)
    assert params.structured_outputs is not None
    assert params.structured_outputs.json == TOOLS[0]["function"]["parameters"]
    message, reason = named.message('{"city": "Oslo"}', "stop")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        [("get_weather", '{"city": "Oslo"}')]
    assert reason == "tool_calls"
    required = plan(request(tools=TOOLS, tool_choice="required"))
    assert required.json_schema is not None and required.json_schema["minItems"] == 1
    message, _ = required.message('[{"name": "get_weather", "parameters": {"city": "Rome"}}]',
                                  "stop")
    assert message.tool_calls[0].function.arguments == '{"city": "Rome"}'


def test_forced_choice_with_another_constraint_is_refused():
    req = request(tools=TOOLS, tool_choice="required",
                  response_format={"type": "json_object"})
    params = req.to_sampling_params()
    with pytest.raises(OpenAIError) as e:
        plan(req).apply(params)
    assert e.value.param == "tool_choice" and "response_format" in e.value.message


def test_markers_that_are_special_tokens_keep_special_tokens():
    params = SamplingParams()
    plan(request(tools=TOOLS), "mistral").apply(params)
    assert params.skip_special_tokens is False
    params = SamplingParams()
    plan(request(tools=TOOLS), "pythonic").apply(params)
    assert params.skip_special_tokens is True
    params = SamplingParams()
    plan(request(), None, "mistral").apply(params)
    assert params.skip_special_tokens is False


def test_tool_call_arguments_reach_the_template_as_objects():
    messages = normalize_messages([{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}}]}])
    assert [c["function"]["arguments"] for c in messages[0]["tool_calls"]] == [{"a": 1}, {}]
    with pytest.raises(ValueError, match="tool call arguments are not JSON"):
        normalize_messages([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}])


def test_stream_delta_json_leaves_out_what_a_delta_does_not_carry():
    streams = ChoiceStreams(plan(request(tools=TOOLS)))
    first = streams.delta(0, '<tool_call>{"name": "get_weather", "arguments": {"city"', False)
    later = streams.delta(0, ': "Oslo"}}</tool_call>', True)
    assert first is not None and later is not None
    one, two = first.model_dump(mode="json"), later.model_dump(mode="json")
    call_id = one["tool_calls"][0]["id"]
    assert call_id.startswith("chatcmpl-tool-")
    assert one == {"tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city"'}}]}
    assert two == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}
