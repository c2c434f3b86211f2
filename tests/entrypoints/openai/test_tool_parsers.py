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

M3 = "]<]minimax[>["  # MiniMax-M3's tag marker

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
    # deepseek_v31: V3.1's bare form only (a function may be named "function")
    ("deepseek_v31", "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("deepseek_v31", "Paris is sunny.", "Paris is sunny.", []),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     '{"q": "a \\"b\\" ü", "n": {"m": [1, {"k": null}]}}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     None, [("function", {"q": 'a "b" ü', "n": {"m": [1, {"k": None}]}})]),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Pa', None, [("get_weather", {"city": "Pa"})]),
    # deepseek_v32: DSML in a function_calls section; string="true|false" types a value
    ("deepseek_v32", 'Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="city" string="true">San Francisco</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
     '<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
     "Let me check.", [("get_weather", {"city": "San Francisco", "days": 3}), ("get_time", {})]),
    ("deepseek_v32", "No call here.", "No call here.", []),
    ("deepseek_v32", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="days" string="true">3</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="where" string="false">{"lat": 1.5}</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="metric" string="false">true</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="tags">["a", "b"]</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="ratio" string="false">about half</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="city" string="true">say "hi"\n\\path <b></｜DSML｜parameter>\n'
     "</｜DSML｜invoke>\n</｜DSML｜function_calls>\nDone.",
     None, [("get_weather", {"days": "3", "where": {"lat": 1.5}, "metric": True,
                             "tags": ["a", "b"], "ratio": "about half",
                             "city": 'say "hi"\n\\path <b>'})]),
    ("deepseek_v32", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="city" string="true">Par', None,
     [("get_weather", {"city": "Par"})]),
    ("deepseek_v32", '<｜DSML｜function_calls><｜DSML｜invoke name="get_weather">'
     '<｜DSML｜parameter name="tags" string="false">[1, 2', None,
     [("get_weather", {"tags": "[1, 2"})]),
    # deepseek_v4: DSML in a tool_calls section; an invoke outside it is a call too
    ("deepseek_v4", 'Checking both.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
     '<｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
     "Checking both.", [("get_weather", {"city": "杭州"}), ("get_time", {})]),
    ("deepseek_v4", "The answer is 42.", "The answer is 42.", []),
    ("deepseek_v4", 'Sure. <｜DSML｜invoke name="get_time">\n</｜DSML｜invoke>\nignored', "Sure.",
     [("get_time", {})]),
    ("deepseek_v4", '<｜DSML｜toolcalls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter '
     'name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
     None, [("get_weather", {"days": 2})]),
    # deepseek_v41: DSML with a space after the marker, in a "calls" section
    ("deepseek_v41", 'On it.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
     '<｜DSML｜ parameter name="city" string="true">Oslo</｜DSML｜ parameter>\n'
     '<｜DSML｜ parameter name="days" string="false">5</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
     '<｜DSML｜ invoke name="get_time">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>',
     "On it.", [("get_weather", {"city": "Oslo", "days": 5}), ("get_time", {})]),
    ("deepseek_v41", "Nothing to call.", "Nothing to call.", []),
    # kimi_k2: a section of calls headed functions.<name>:<n>
    ("kimi_k2", "I'll check.<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>\n<|tool_call_begin|>'
     "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>\n"
     "<|tool_calls_section_end|>",
     "I'll check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("kimi_k2", "Hello! How can I help?", "Hello! How can I help?", []),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>"
     '{"city": "x"}<|tool_call_end|><|tool_call_begin|>functions.my.tool:3'
     '<|tool_call_argument_begin|>{"where": {"lat": 1.5, "tags": ["a"]}, "q": "line\\nnext '
     '\\u00e9"}<|tool_call_end|><|tool_calls_section_end|>Done.',
     None, [("my.tool", {"where": {"lat": 1.5, "tags": ["a"]}, "q": "line\nnext é"})]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Pa', None, [("get_weather", {"city": "Pa"})]),
    # kimi_k3: XTML response and tools channels
    ("kimi_k3", "Let me check.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call "
     'tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>San '
     'Francisco<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3'
     '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="get_time" index="2"<|sep|>'
     "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>",
     "Let me check.", [("get_weather", {"city": "San Francisco", "days": 3}), ("get_time", {})]),
    ("kimi_k3", "<|open|>response<|sep|>Hello there.<|close|>response<|sep|><|close|>message<|sep|>",
     "Hello there.", []),
    ("kimi_k3", '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" '
     'index="1"<|sep|><|open|>argument key="say &quot;hi&quot;" type="string"<|sep|>a "b"\n'
     '<c> \\d<|close|>argument<|sep|><|open|>argument key="where" type="object"<|sep|>{"lat":'
     ' 1}<|close|>argument<|sep|><|open|>argument key="tags" type="array"<|sep|>[1, "x"]'
     '<|close|>argument<|sep|><|open|>argument key="metric" type="boolean"<|sep|>false'
     '<|close|>argument<|sep|><|open|>argument key="ratio" type="number"<|sep|>not a number'
     "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
     None, [("get_weather", {'say "hi"': 'a "b"\n<c> \\d', "where": {"lat": 1},
                             "tags": [1, "x"], "metric": False, "ratio": "not a number"})]),
    ("kimi_k3", '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>json '
     'type="object"<|sep|>{"city": "Rome", "days": 2}<|close|>json<|sep|><|close|>call<|sep|>'
     "<|close|>tools<|sep|>", None, [("get_weather", {"city": "Rome", "days": 2})]),
    ("kimi_k3", '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>'
     'argument key="city" type="string"<|sep|>Ber', None, [("get_weather", {"city": "Ber"})]),
    # k2_horizon: IFM calls as xml, xml_typed or json
    ("k2_horizon", "Checking.<ifm|tool_calls><ifm|tool_call>get_weather<ifm|arg_key>city"
     "</ifm|arg_key><ifm|arg_value>Paris</ifm|arg_value><ifm|arg_key>days</ifm|arg_key>"
     "<ifm|arg_value>3</ifm|arg_value></ifm|tool_call><ifm|tool_call>get_time</ifm|tool_call>"
     "</ifm|tool_calls>",
     "Checking.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("k2_horizon", "Just text.", "Just text.", []),
    ("k2_horizon", "<ifm|tool_calls><ifm|tool_call>get_weather<ifm|arg_key>days</ifm|arg_key>"
     "<ifm|arg_type>integer</ifm|arg_type><ifm|arg_value>4</ifm|arg_value><ifm|arg_key>extra"
     '</ifm|arg_key><ifm|arg_type>array[string]</ifm|arg_type><ifm|arg_value>["x", "y"]'
     "</ifm|arg_value><ifm|arg_key>note</ifm|arg_key><ifm|arg_type>any</ifm|arg_type>"
     "<ifm|arg_value>42</ifm|arg_value></ifm|tool_call></ifm|tool_calls>",
     None, [("get_weather", {"days": 4, "extra": ["x", "y"], "note": "42"})]),
    ("k2_horizon", '<ifm|tool_calls><ifm|tool_call>{"name": "get_weather", "arguments": {"city": '
     '"Lima"}}</ifm|tool_call></ifm|tool_calls> Anything else?', "Anything else?",
     [("get_weather", {"city": "Lima"})]),
    ("k2_horizon", "<ifm|tool_calls><ifm|tool_call>get_weather<ifm|arg_key>city</ifm|arg_key>"
     "<ifm|arg_value>Li", None, [("get_weather", {"city": "Li"})]),
    # glm45 / glm47 / ling3: key / value pairs after the name
    ("glm45", "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
     "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>"
     "get_time\n</tool_call>",
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("glm45", "It is 21 °C in Paris.", "It is 21 °C in Paris.", []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> New York, a < b "
     "</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n<arg_key>ratio"
     "</arg_key>\n<arg_value>0.5</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>"
     '["a", "b"]</arg_value>\n<arg_key>where</arg_key>\n<arg_value>{"lat": 1.5}</arg_value>\n'
     "<arg_key>x</arg_key>\n<arg_value>5</arg_value>\n</tool_call>",
     None, [("get_weather", {"city": " New York, a < b ", "metric": True, "ratio": 0.5,
                             "tags": ["a", "b"], "where": {"lat": 1.5}, "x": "5"})]),
    ("glm45", "x <tool_call> is markup", "x <tool_call> is markup", []),
    ("glm47", "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
     "</tool_call><tool_call>get_time</tool_call>",
     "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("glm47", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par", None,
     [("get_weather", {"city": "Par"})]),
    ("ling3", "I will look it up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
     "Oslo</arg_value>\n</tool_call>", "I will look it up.", [("get_weather", {"city": "Oslo"})]),
    # minimax_m2: invoke elements with parameter children
    ("minimax_m2", 'Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter '
     'name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke '
     'name="get_time">\n</invoke>\n</minimax:tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("minimax_m2", "Nothing to do.", "Nothing to do.", []),
    ("minimax_m2", "<minimax:tool_call><invoke name='get_weather'><parameter name='metric'>false"
     '</parameter><parameter name=tags>["a"]</parameter><parameter name="where">{"lat": -1}'
     "</parameter></invoke></minimax:tool_call> Done.",
     "Done.", [("get_weather", {"metric": False, "tags": ["a"], "where": {"lat": -1}})]),
    ("minimax_m2", '<minimax:tool_call><invoke name="get_weather"><parameter name="city"> Rome'
     '<parameter name="days">2</parameter></invoke></minimax:tool_call>', None,
     [("get_weather", {"city": " Rome", "days": 2})]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Ro',
     None, [("get_weather", {"city": "Ro"})]),
    # minimax_m3: namespaced elements, nested
    ("minimax_m3", f'Checking.\n{M3}<tool_call>\n{M3}<invoke name="get_weather">{M3}<city>Paris'
     f'{M3}</city>{M3}<days>3{M3}</days>{M3}</invoke>\n{M3}<invoke name="get_time">{M3}'
     f"</invoke>\n{M3}</tool_call>",
     "Checking.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("minimax_m3", "Plain answer.", "Plain answer.", []),
    ("minimax_m3", f'{M3}<tool_call>{M3}<invoke name="get_weather">{M3}<tags>{M3}<item>a{M3}'
     f"</item>{M3}<item>b{M3}</item>{M3}</tags>{M3}<where>{M3}<lat>1.5{M3}</lat>{M3}<k>1{M3}"
     f"</k>{M3}<k>2{M3}</k>{M3}</where>{M3}<metric>true{M3}</metric>{M3}</invoke>{M3}"
     "</tool_call> trailing text",
     None, [("get_weather", {"tags": ["a", "b"], "where": {"lat": "1.5", "k": ["1", "2"]},
                             "metric": True})]),
    ("minimax_m3", f'{M3}<tool_call>{M3}<invoke name="get_weather">{M3}<city>Oslo{M3}</city>{M3}'
     "<days>4", None, [("get_weather", {"city": "Oslo"})]),
    # mimo: Qwen3 XML with values kept verbatim
    ("mimo", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
     "<parameter=days>3</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>"
     "\n</function>\n</tool_call>",
     "Sure.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("mimo", "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
     "</function>\n</tool_call>", None, [("get_weather", {"city": "\nLima\n"})]),
    ("mimo", "Nothing to call.", "Nothing to call.", []),
    # seed_oss: Qwen3 XML between <seed:tool_call> tags, Python literals for non-strings
    ("seed_oss", "Let me check.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris"
     "</parameter>\n<parameter=metric>True</parameter>\n<parameter=tags>['a', 'b']</parameter>\n"
     "</function>\n</seed:tool_call>\n<seed:tool_call>\n<function=get_time>\n</function>\n"
     "</seed:tool_call>",
     "Let me check.", [("get_weather", {"city": "Paris", "metric": True, "tags": ["a", "b"]}),
                       ("get_time", {})]),
    ("seed_oss", "Use <tool_call> tags.", "Use <tool_call> tags.", []),
    ("seed_oss", "<seed:tool_call>\n<function=get_weather>\n<parameter=days>7", None,
     [("get_weather", {"days": 7})]),
    # step3: steptml invokes inside DeepSeek-like markers, values stripped
    ("step3", "Let me check.<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>"
     '<steptml:invoke name="get_weather"><steptml:parameter name="city">Paris'
     '</steptml:parameter><steptml:parameter name="days">3</steptml:parameter></steptml:invoke>'
     "<｜tool_call_end｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="
     '"get_time"></steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>',
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("step3", "No tools today.", "No tools today.", []),
    ("step3", "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke "
     'name="get_weather">\n<steptml:parameter name="city">  Rome \n</steptml:parameter>\n'
     '<steptml:parameter name="ratio"> 0.5 </steptml:parameter>\n</steptml:invoke>'
     "<｜tool_call_end｜><｜tool_calls_end｜> Done.",
     "Done.", [("get_weather", {"city": "Rome", "ratio": 0.5})]),
    # qwen3_xml, step3p5 and qwen3_json: qwen3_coder's and hermes' formats under other names
    ("qwen3_xml", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", None,
     [("get_time", {})]),
    ("step3p5", "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
     "</function>\n</tool_call>", None, [("get_weather", {"days": 2})]),
    ("qwen3_json", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', None,
     [("get_time", {})]),
    # longcat: hermes JSON between <longcat_tool_call> tags
    ("longcat", 'Checking.\n<longcat_tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</longcat_tool_call>\n<longcat_tool_call>\n{"name": "get_time", "arguments": '
     "{}}\n</longcat_tool_call>",
     "Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("longcat", "All done.", "All done.", []),
    ("longcat", '<longcat_tool_call>{"name": "get_weather", "arguments": {"tags": ["a", ', None,
     [("get_weather", {"tags": ["a"]})]),
    # hunyuan_a13b: one JSON array between <tool_calls> tags
    ("hunyuan_a13b", 'Let me check.<tool_calls>[{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}, {"name": "get_time", "arguments": {}}]</tool_calls>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hunyuan_a13b", "助手：Hello!", "Hello!", []),
    ("hunyuan_a13b", "Hello, 助手：", "Hello, 助手：", []),
    ("hunyuan_a13b", '<tool_calls>[{"name": "get_weather", "arguments": {"days": 1', None,
     [("get_weather", {"days": 1})]),
    # hy_v3 / hy_v4: key / value calls, every marker with the checkpoint's suffix
    ("hy_v3", "Let me check.<tool_calls:opensource>\n<tool_call:opensource>get_weather"
     "<tool_sep:opensource>\n<arg_key:opensource>city</arg_key:opensource>\n"
     "<arg_value:opensource>Paris</arg_value:opensource>\n<arg_key:opensource>days"
     "</arg_key:opensource>\n<arg_value:opensource>3</arg_value:opensource>\n"
     "</tool_call:opensource>\n<tool_call:opensource>get_time<tool_sep:opensource>\n"
     "</tool_call:opensource>\n</tool_calls:opensource>",
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    ("hy_v3", "x <tool_calls here> y", "x <tool_calls here> y", []),
    ("hy_v3", "<tool_calls><tool_call>get_weather<tool_sep><arg_key>where</arg_key><arg_value>"
     '{"lat": 1}</arg_value></tool_call></tool_calls>', None,
     [("get_weather", {"where": {"lat": 1}})]),
    ("hy_v4", "On it.<tool_calls:6124c78e><tool_call:6124c78e>get_weather<arg_key:6124c78e>city"
     "</arg_key:6124c78e><arg_value:6124c78e>Paris</arg_value:6124c78e></tool_call:6124c78e>"
     "<tool_call:6124c78e>get_time</tool_call:6124c78e></tool_calls:6124c78e>dropped",
     "On it.", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("hy_v4", "Plain reply.", "Plain reply.", []),
    ("hy_v4", "<tool_calls><tool_call>get_weather<arg_key>days</arg_key><arg_value>1", None,
     [("get_weather", {"days": 1})]),
]


def _ids(vectors):
    return [f"{v[0]}-{i}" for i, v in enumerate(vectors)]


@pytest.mark.parametrize("name, text, content, calls", VECTORS, ids=_ids(VECTORS))
def test_vectors_whole_and_streamed(name, text, content, calls):
    check_vector(name, text, content, calls)


def _refusal(name):
    """The ValueError a parser's constructor refuses with (formats text cannot carry)."""
    try:
        get_tool_parser(name)(TOOLS)
    except ValueError as e:
        return str(e)
    return None


def test_every_family_has_vectors():
    refused = {target for name, target in TOOL_PARSERS.items() if _refusal(name) is not None}
    families = set(TOOL_PARSERS.values()) - refused
    covered = {TOOL_PARSERS[v[0]] for v in [*VECTORS, *VECTORS_B]}
    assert sorted(families - covered) == []


def test_a_refused_family_is_refused_by_its_name():
    for name in TOOL_PARSERS:
        refusal = _refusal(name)
        assert refusal is None or repr(name) in refusal, refusal


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
    ("Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
     "name and its value}.", "llama3_json"),
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


# ---------------------------------------------------------------------------------------
# What the vectors cannot show
# ---------------------------------------------------------------------------------------


def test_kimi_k2_call_ids_are_its_headers():
    calls = get_tool_parser("kimi_k2")().parse(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_begin|>functions.get_time:1"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>").tool_calls
    assert [c.id for c in calls] == ["functions.get_time:0", "functions.get_time:1"]


ORDER = {"type": "function", "function": {"name": "create_order", "parameters": {
    "type": "object", "properties": {
        "user_id": {"type": "integer"},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}}}},
        "notes": {"type": "array"},
        "gift": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}}}}}


def test_minimax_m3_nested_elements_follow_the_schema():
    text = (f'{M3}<tool_call>{M3}<invoke name="create_order">{M3}<user_id>42{M3}</user_id>'
            f"{M3}<items>{M3}<item>{M3}<sku>007{M3}</sku>{M3}<qty>2{M3}</qty>{M3}</item>{M3}"
            f"</items>{M3}<notes>{M3}</notes>{M3}<gift>false{M3}</gift>{M3}</invoke>{M3}"
            "</tool_call>")
    expected = {"user_id": 42, "items": [{"sku": "007", "qty": 2}], "notes": [], "gift": False}
    make = get_tool_parser("minimax_m3")
    whole = make([ORDER]).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == \
        [("create_order", expected)]
    for cuts in cut_sets(text)[:40]:
        deltas = replay(lambda: make([ORDER]), text, cuts)
        check_delta_rules(deltas)
        assert [c.arguments for c in collect(deltas).tool_calls] == \
            [whole.tool_calls[0].arguments]


@pytest.mark.parametrize("name, text, streamed", [
    ("deepseek_v4", '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter '
     'name="city" string="true">Par', '{"city": "Par'),
    ("glm47", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par", '{"city": "Par'),
    ("minimax_m2", '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Par',
     '{"city": "Par'),
    ("kimi_k3", '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>'
     'argument key="city" type="string"<|sep|>Par', '{"city": "Par'),
    ("hy_v3", "<tool_calls><tool_call>get_weather<tool_sep><arg_key>city</arg_key><arg_value>Par",
     '{"city": "Par'),
])
def test_string_values_stream_before_they_end(name, text, streamed):
    delta = get_tool_parser(name)(TOOLS).push(text)
    assert [c.name for c in delta.tool_calls] == ["get_weather"]
    assert "".join(c.arguments for c in delta.tool_calls) == streamed


def test_hy_markers_take_the_suffix_of_the_section():
    text = ("<tool_calls:abc><tool_call:xyz>get_time</tool_call:xyz><tool_call:abc>get_time"
            "</tool_call:abc></tool_calls:abc>")
    calls = get_tool_parser("hy_v4")().parse(text).tool_calls
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]


def test_group_a_markers_keep_special_tokens():
    keeps = {name for name in TOOL_PARSERS if get_tool_parser(name).needs_special_tokens}
    assert {"deepseek_v31", "deepseek_v32", "deepseek_v4", "deepseek_v41", "kimi_k2", "kimi_k3",
            "k2_horizon", "glm45", "glm47", "ling3", "minimax_m2", "seed_oss", "step3",
            "hy_v3", "hy_v4"} <= keeps
    assert "minimax_m3" not in keeps  # its markers are ordinary added tokens


def test_a_parser_that_cannot_work_here_is_refused_at_start_up(capsys):
    with pytest.raises(SystemExit) as e:
        parse_server_args(["--tool-call-parser", "hf"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("server: --tool-call-parser hf: ")
    assert "response_template" in err[0]
