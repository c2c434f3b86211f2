"""Tool calling end to end: Qwen2.5-Coder (its template writes hermes-style tools) behind a
real vllm-server, driven through the openai SDK."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_utils import COMMON, start_server

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "the city"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                       "required": ["zone"]}}}]
NAMES = {t["function"]["name"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_server(qwen_path):
    s = start_server("--model", qwen_path, *COMMON, "--num-blocks", "40",
                     "--max-model-len", "1280", "--tool-call-parser", "auto",
                     "--reasoning-parser", "auto")
    yield s
    s.stop()


def ask(server, **kwargs):
    return server.client().chat.completions.create(
        model=None, messages=kwargs.pop("messages", ASK), tools=TOOLS, temperature=0,
        max_tokens=kwargs.pop("max_tokens", 80), **kwargs)


def streamed(server, **kwargs):
    """The stream assembled as a message, checking the delta rules on the way."""
    content, calls, finish = "", {}, None
    last = -1
    for chunk in ask(server, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index >= last, "tool call indexes only increase"
            last = call.index
            if call.id is not None:
                assert call.index not in calls, "a call's id comes once"
                assert call.function.name, "the first delta of a call names the function"
                calls[call.index] = [call.function.name, ""]
            else:
                assert call.function is None or call.function.name is None
            calls[call.index][1] += call.function.arguments or "" if call.function else ""
        finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def as_tuple(response):
    message = response.choices[0].message
    return (message.content or None,
            [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
            response.choices[0].finish_reason)


def whole_and_streamed(server, **kwargs):
    """The same greedy request, whole and streamed, run side by side (one batch)."""
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(ask, server, **kwargs)
        stream = pool.submit(streamed, server, **kwargs)
        return whole.result(), stream.result()


def test_parsers_resolved_from_the_template(tool_server):
    lines = tool_server.stderr_lines
    assert "server: --tool-call-parser auto: the chat template calls for 'hermes'" in lines
    assert any(ln.startswith("server: --reasoning-parser auto: ") and "off" in ln
               for ln in lines)


def test_named_tool_choice_returns_that_call(tool_server):
    r, stream = whole_and_streamed(tool_server, tool_choice=NAMED, max_tokens=32)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
    assert stream == as_tuple(r)


def test_required_tool_choice_returns_calls_of_the_tools(tool_server):
    r, stream = whole_and_streamed(tool_server, tool_choice="required", max_tokens=64)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        assert call.function.name in NAMES
        assert isinstance(json.loads(call.function.arguments), dict)
    assert stream == as_tuple(r)


def test_auto_gives_content_or_well_formed_calls(tool_server):
    # tools given: tool_choice defaults to auto
    r, stream = whole_and_streamed(tool_server, max_tokens=40)
    content, calls, finish = as_tuple(r)
    assert content or calls
    for name, arguments in calls:
        assert name in NAMES and isinstance(json.loads(arguments), dict)
        assert "<tool_call>" not in (content or "")
    assert finish == ("tool_calls" if calls else "stop") or finish == "length"
    assert stream == (content, calls, finish)


def test_a_tool_round_trip_renders(tool_server):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "clear"}'}]
    r = ask(tool_server, messages=messages, tool_choice="none", max_tokens=6)
    assert r.choices[0].message.tool_calls in (None, [])
    assert r.choices[0].message.content


def test_bad_tool_choices_are_400(tool_server):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        ask(tool_server, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        ask(tool_server, tool_choice="required", response_format={"type": "json_object"})
