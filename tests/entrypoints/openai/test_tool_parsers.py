"""Tool-call parsers: each family's documented format, whole and replayed as a stream.

Every vector is hand-written from the model family's format. Each is parsed whole, then
replayed in pieces (one character at a time, every two-piece cut, random cuts): the stream
must give the same content and calls, with OpenAI's delta rules (id and name once, on the
first delta of a call; indexes only increase; argument fragments concatenate to valid JSON
equal to the whole response's arguments).
"""

from __future__ import annotations

import json

import pytest
from tool_parser_utils import TOOLS, WEATHER, check_delta_rules, check_vector, cut_sets, replay
from tool_vectors_b import VECTORS_B

from vllmpy.entrypoints.openai.cli_args import parse_server_args, resolve_output_parsers
from vllmpy.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    detect_tool_parser,
    get_tool_parser,
)
from vllmpy.entrypoints.openai.tool_parsers.abstract import collect
from vllmpy.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    named_schema,
    required_schema,
)
from vllmpy.entrypoints.openai.tool_parsers.json_stream import JsonValueWriter, canonical_json


# (parser, model text, expected content, expected [(name, arguments as a JSON value)])
VECTORS = [
    # hermes: Hermes 2 Pro / Qwen2.5 / Qwen3
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
     '"arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("hermes", "The answer is 4.\n", "The answer is 4.\n", []),
    ("hermes", '<tool_call>{"arguments": {"q": "a \\"quoted\\" \\u00e9 \\ud83d\\ude00"}, '
     '"name": "search"}</tool_call>', None, [("search", {"q": 'a "quoted" é 😀'})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}\n</tool_call>',
     None, [("f", {"x": [1, 2]})]),
    ("hermes", "x < y and <tool_call> is not followed by JSON", "x < y and <tool_call> is not "
     "followed by JSON", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"code": "if a < b:\\n    '
     'print(\'</tool_call>\')"}}\n</tool_call>', None,
     [("f", {"code": "if a < b:\n    print('</tool_call>')"})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', None, [("f", {"a": 1})]),
    # qwen3_coder: Qwen3-Coder XML, values typed by the tool schema
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan "
     "Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\n"
     "true\n</parameter>\n<parameter=ratio>\n0.25\n</parameter>\n<parameter=tags>\n"
     '["a", "b"]\n</parameter>\n<parameter=where>\n{"lat": 1.5}\n</parameter>\n'
     "</function>\n</tool_call>",
     "Sure.", [("get_weather", {"city": "San Francisco", "days": 3, "metric": True,
                                "ratio": 0.25, "tags": ["a", "b"], "where": {"lat": 1.5}})]),
    ("qwen3_coder", "<tool_call>\n<function=write_file>\n<parameter=content>\nline 1\n"
     '  "two"\n\n</parameter>\n<parameter=path>\n/tmp/x\n</parameter>\n</function>\n'
     "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     None, [("write_file", {"content": 'line 1\n  "two"\n', "path": "/tmp/x"}),
            ("get_time", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\nnull\n"
     "</parameter>\n<parameter=city>\nOslo\n</function>\n</tool_call>",
     None, [("get_weather", {"days": None, "city": "Oslo"})]),
    # llama3_json: Llama 3.x JSON, optional <|python_tag|>, ';' between calls
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("llama3_json", '{"name": "get_weather", "arguments": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("llama3_json", '{"temperature": 21}', '{"temperature": 21}', []),
    # mistral: both the array form and the v11+ name[ARGS] form
    ("mistral", 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}, {"name": "get_time", "arguments": {}}]',
     "Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", "No tools needed.", "No tools needed.", []),
    # pythonic: a Python list of keyword calls
    ("pythonic", '[get_weather(city="San Francisco", metric=True, tags=("a", None)), '
     "get_time()]",
     None, [("get_weather", {"city": "San Francisco", "metric": True, "tags": ["a", None]}),
            ("get_time", {})]),
    ("pythonic", "<|python_start|>[search(q='it\\'s [1] (x)')]<|python_end|>", None,
     [("search", {"q": "it's [1] (x)"})]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    # deepseek_v3: V3 fenced form and V3.1 bare form
    ("deepseek_v3", "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
     "function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Lima"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None,
     [("get_weather", {"city": "Lima"})]),
    # granite: a JSON array after <|tool_call|> (3.0) or <tool_call> (3.1+)
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {}}]', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("granite", '<tool_call>[{"name": "get_weather", "arguments": {"days": 2}}]', None,
     [("get_weather", {"days": 2})]),
    ("granite", "Hello there.", "Hello there.", []),
    # internlm: InternLM2 plugin actions
    ("internlm", "I will check.<|action_start|><|plugin|>\n{\"name\": \"get_weather\", "
     '"parameters": {"city": "Paris"}}<|action_end|>', "I will check.",
     [("get_weather", {"city": "Paris"})]),
]


def _ids(vectors):
    return [f"{v[0]}-{i}" for i, v in enumerate(vectors)]


@pytest.mark.parametrize("name, text, content, calls", VECTORS, ids=_ids(VECTORS))
def test_vectors_whole_and_streamed(name, text, content, calls):
    check_vector(name, text, content, calls)


def test_every_family_has_vectors():
    families = set(TOOL_PARSERS.values())
    covered = {TOOL_PARSERS[v[0]] for v in [*VECTORS, *VECTORS_B]}
    assert sorted(families - covered) == []


def test_arguments_stream_before_the_call_ends():
    parser = get_tool_parser("hermes")(TOOLS)
    first = parser.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert [(c.index, c.name) for c in first.tool_calls] == [(0, "get_weather")]
    assert first.tool_calls[0].id and first.tool_calls[0].arguments == '{"city": "Par'
    second = parser.push('is"}}\n</tool_call>')
    assert [(c.id, c.name, c.arguments) for c in second.tool_calls] == [(None, None, 'is"}')]


def test_content_streams_and_holds_only_possible_markers():
    parser = get_tool_parser("hermes")(TOOLS)
    assert parser.push("Hello <tool").content == "Hello"
    assert parser.push("box> and more").content == " <toolbox> and more"
    assert parser.finish().content == ""


def test_cut_short_calls_still_parse():
    for name, text in [("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "x'),
                       ("hermes", '<tool_call>{"name": "f", "arguments": {}}\n</tool_'),
                       ("pythonic", "<|python_start|>[f(a=1)]<|python_e"),
                       ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\nhal"),
                       ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n"
                                       "</parameter>\n</func"),
                       ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=ci"),
                       ("mistral", '[TOOL_CALLS]f[ARGS]{"a": tr'),
                       ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                                       '<｜tool▁sep｜>f\n```json\n{"a": 1.5')]:
        whole = get_tool_parser(name)().parse(text)
        assert [c.name for c in whole.tool_calls] == ["f"], name
        assert whole.content is None, (name, whole.content)
        assert isinstance(json.loads(whole.tool_calls[0].arguments), dict)


def test_mistral_call_ids_are_nine_alphanumerics():
    calls = get_tool_parser("mistral")().parse(
        '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[CALL_ID]Xy12Zz789[ARGS]{}').tool_calls
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    assert calls[1].id == "Xy12Zz789"


def test_markers_special_tokens_are_kept_for():
    keeps = {name for name in TOOL_PARSERS if get_tool_parser(name).needs_special_tokens}
    assert "pythonic" not in keeps
    assert {"hermes", "mistral", "internlm", "granite", "llama3_json"} <= keeps


# ---------------------------------------------------------------------------------------
# JSON written back canonically
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    '{"a":1,"b":[true,false,null],"c":{"d":"e\\n\\t\\u0001"},"f":-1.5e3}',
    '  [ ] ', '"just a string"', "{}", '{"emoji": "\\ud83d\\ude00", "raw": "é"}',
])
def test_json_writer_matches_json_dumps(text):
    expected = json.dumps(json.loads(text), ensure_ascii=False).replace("-1500.0", "-1.5e3")
    assert canonical_json(text) == expected
    for cuts in cut_sets(text):
        writer, out, last = JsonValueWriter(), "", 0
        for cut in [*cuts, len(text)]:
            used, written = writer.feed(text[last:cut])
            out += written
            last += used
            if writer.done:
                break
        out += writer.feed("", final=True)[1]
        assert out == expected


def test_json_writer_close_completes_every_prefix():
    text = '{"a": [1, {"b": "x\\u00e9y"}], "c": true, "d": -2}'
    for cut in range(1, len(text)):
        writer = JsonValueWriter()
        _, out = writer.feed(text[:cut])
        json.loads(out + writer.close())


def test_json_writer_stops_at_what_is_not_json():
    writer = JsonValueWriter()
    used, out = writer.feed('{"a": 1 x')
    assert writer.error and used == 8 and out == '{"a": 1'


# ---------------------------------------------------------------------------------------
# tool_choice "required" and a named function
# ---------------------------------------------------------------------------------------


def test_required_schema_is_an_array_of_named_shapes():
    schema = required_schema(TOOLS)
    assert schema["type"] == "array" and schema["minItems"] == 1
    shapes = schema["items"]["anyOf"]
    assert [s["properties"]["name"]["enum"] for s in shapes] == [["get_weather"], ["get_time"]]
    assert shapes[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert shapes[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert all(s["required"] == ["name", "parameters"] for s in shapes)
    assert named_schema(TOOLS, "get_weather") == WEATHER["function"]["parameters"]


FORCED = [
    (lambda: RequiredToolParser(TOOLS), '[{"name": "get_weather", "parameters": {"city": '
     '"Paris"}}, {"name": "get_time", "parameters": {}}]',
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (lambda: NamedToolParser(TOOLS, name="get_weather"), '{"city": "Paris", "days": 2}',
     [("get_weather", {"city": "Paris", "days": 2})]),
]


@pytest.mark.parametrize("make, text, calls", FORCED)
def test_forced_forms_whole_and_streamed(make, text, calls):
    whole = make().parse(text)
    assert whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    for cuts in cut_sets(text):
        deltas = replay(make, text, cuts)
        check_delta_rules(deltas)
        assert [(c.name, c.arguments) for c in collect(deltas).tool_calls] == \
            [(c.name, c.arguments) for c in whole.tool_calls]


# ---------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------


def test_parser_flags_default_to_hermes_and_none():
    args = parse_server_args([])
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "none")
    assert resolve_output_parsers(args, "{{ messages }}") == ("hermes", None)
    off = parse_server_args(["--tool-call-parser", "none"])
    assert resolve_output_parsers(off, "<tool_call>") == (None, None)


@pytest.mark.parametrize("flag, name", [("--tool-call-parser", "hermes2"),
                                        ("--reasoning-parser", "deepseek")])
def test_unknown_parser_is_refused_naming_the_choices(flag, name, capsys):
    with pytest.raises(SystemExit) as e:
        parse_server_args([flag, name])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"server: {flag} '{name}' is not a known parser")
    registry = TOOL_PARSERS if flag == "--tool-call-parser" else None
    for choice in [*(registry or ["think_auto", "deepseek_r1", "qwen3", "mistral"]), "auto",
                   "none"]:
        assert choice in err[0]


def test_auto_tool_choice_with_no_parser_is_the_two_line_refusal(capsys):
    with pytest.raises(SystemExit) as e:
        parse_server_args(["--enable-auto-tool-choice", "--tool-call-parser", "none"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "server: Error: --enable-auto-tool-choice requires --tool-call-parser",
        "server: (--tool-call-parser none selects NO parser; name a parser, or drop "
        "--tool-call-parser to keep the hermes default)"]


def test_auto_tool_choice_stays_inert_with_its_notice(capsys):
    args = parse_server_args(["--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    assert args.tool_call_parser == "mistral"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("server: accepted '--enable-auto-tool-choice'")
    assert "no effect" in err[0] and "always on" in err[0]


@pytest.mark.parametrize("template, expected", [
    ('{{"<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args>}"}}', "hermes"),
    ("<tool_call>\n<function=name>\n<parameter=x>", "qwen3_coder"),
    ("{{ '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "deepseek_v3"),
    ("<|start_of_role|>available_tools<|end_of_role|> <|tool_call|>", "granite"),
    ("<|action_start|><|plugin|>", "internlm"),
    ("[func_name1(params_name1=params_value1, ...)]", "pythonic"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("{{ messages }}", None),
])
def test_auto_detection_from_the_chat_template(template, expected, capsys):
    assert detect_tool_parser(template) == expected
    args = parse_server_args(["--tool-call-parser", "auto"])
    capsys.readouterr()
    assert resolve_output_parsers(args, template)[0] == expected
    line = capsys.readouterr().err.strip()
    assert line.startswith("server: --tool-call-parser auto: ")
    assert (repr(expected) in line) if expected else ("off" in line)
