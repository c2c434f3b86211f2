"""What the tool-parser tests share: the request's tools, stream replays cut every way,
and the checks that a replay keeps OpenAI's delta rules and agrees with the whole parse."""

from __future__ import annotations

import json
import random

from vllmpy.entrypoints.openai.tool_parsers import get_tool_parser
from vllmpy.entrypoints.openai.tool_parsers.abstract import ParsedDelta, ToolParser, collect

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "ratio": {"type": "number"},
        "tags": {"type": "array"}, "where": {"type": "object"}}}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "get_time"}}]


def replay(make: type[ToolParser] | object, text: str, cuts: list[int]) -> list[ParsedDelta]:
    parser = make()  # type: ignore[operator]
    deltas, last = [], 0
    for cut in [*cuts, len(text)]:
        deltas.append(parser.push(text[last:cut]))
        last = cut
    deltas.append(parser.finish())
    return deltas


def check_delta_rules(deltas: list[ParsedDelta]) -> None:
    opened: set[int] = set()
    last = -1
    for d in deltas:
        for call in d.tool_calls:
            assert call.index >= last, "call indexes must not go back"
            last = call.index
            if call.id is not None:
                assert call.index not in opened, "id and name come once per call"
                assert call.name, "the first delta of a call names the function"
                assert call.index == len(opened), "calls are numbered 0, 1, 2, ..."
                opened.add(call.index)
            else:
                assert call.name is None and call.index in opened


def cut_sets(text: str) -> list[list[int]]:
    rng = random.Random(len(text))
    sets = [list(range(1, len(text)))]  # one character at a time
    sets += [[i] for i in range(1, len(text))]  # every two-piece cut
    for _ in range(20):
        sets.append(sorted(rng.sample(range(1, len(text)), min(len(text) - 1,
                                                               rng.randint(1, 12)))))
    return sets


def check_vector(name: str, text: str, content: str | None, calls: list) -> None:
    """Parse ``text`` whole with parser ``name`` and check content and calls; then replay
    it cut every way and check the stream gives the same, keeping the delta rules."""
    cls = get_tool_parser(name)
    whole = cls(TOOLS).parse(text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert len({c.id for c in whole.tool_calls}) == len(calls)
    for cuts in cut_sets(text):
        deltas = replay(lambda: cls(TOOLS), text, cuts)
        check_delta_rules(deltas)
        streamed = collect(deltas)
        assert streamed.content == whole.content, cuts
        assert [(c.name, c.arguments) for c in streamed.tool_calls] == \
            [(c.name, c.arguments) for c in whole.tool_calls], cuts
