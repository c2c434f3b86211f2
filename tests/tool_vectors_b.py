"""Tool-call vectors of the second group of families (see test_tool_parsers_b.py):
(parser, model text, expected content, expected [(name, arguments as a JSON value)]).

Each is written by hand from the family's format as its chat template renders an
assistant turn (and as vLLM's parser for it reads one)."""

from __future__ import annotations

_PARIS = ("get_weather", {"city": "Paris"})
_TIME = ("get_time", {})

# PLaMo 3's markers
_P_REQS, _P_REQS_END = "<|plamo:begin_tool_requests:plamo|>", "<|plamo:end_tool_requests:plamo|>"
_P_REQ, _P_REQ_END = "<|plamo:begin_tool_request:plamo|>", "<|plamo:end_tool_request:plamo|>"
_P_NAME, _P_NAME_END = "<|plamo:begin_tool_name:plamo|>", "<|plamo:end_tool_name:plamo|>"
_P_ARGS = "<|plamo:begin_tool_arguments:plamo|><|plamo:constrain|>json<|plamo:msg|>"
_P_ARGS_END = "<|plamo:end_tool_arguments:plamo|>"


def _plamo(name: str, args: str) -> str:
    return _P_REQ + _P_NAME + name + _P_NAME_END + _P_ARGS + args + _P_ARGS_END + _P_REQ_END

VECTORS_B: list[tuple[str, str, str | None, list[tuple[str, object]]]] = [
    # jamba: one JSON array between <tool_calls> tags
    ("jamba", 'Let me check.<tool_calls>[{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}, {"name": "get_time", "arguments": {}}]</tool_calls>',
     "Let me check.", [_PARIS, _TIME]),
    ("jamba", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("jamba", '<tool_calls>[{"name": "get_weather", "arguments": {"where": {"lat": 1.5, '
     '"tags": ["a", "b\\"c"]}, "days": 3}}]</tool_calls>', None,
     [("get_weather", {"where": {"lat": 1.5, "tags": ["a", 'b"c']}, "days": 3})]),
    ("jamba", '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Par', None,
     [("get_weather", {"city": "Par"})]),
    ("jamba", "<tool_calls> are tags", "<tool_calls> are tags", []),
    # phi4_mini_json: functools[...] (Phi-4-mini, Firefunction v2)
    ("phi4_mini_json", 'Sure. functools[{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}, {"name": "get_time", "parameters": {}}]', "Sure.", [_PARIS, _TIME]),
    ("phi4_mini_json", "I like functools in Python.", "I like functools in Python.", []),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "S\\u00e3o '
     'Paulo", "metric": false}}', None,
     [("get_weather", {"city": "São Paulo", "metric": False})]),
    # apertus: [{"name": {args}}] between <|tools_prefix|> and <|tools_suffix|>
    ("apertus", 'I will check. <|tools_prefix|>[{"get_weather": {"city": "Paris"}}, '
     '{"get_time": {}}]<|tools_suffix|>', "I will check.", [_PARIS, _TIME]),
    ("apertus", "No tools needed.", "No tools needed.", []),
    ("apertus", '<|tools_prefix|>[{"get_weather": {"days": 2, "tags": [null, true]}}, '
     '{"get_time": {"zone": "UT', None,
     [("get_weather", {"days": 2, "tags": [None, True]}), ("get_time", {"zone": "UT"})]),
    ("apertus", '<|tools_prefix|>["not a call"]<|tools_suffix|>',
     '<|tools_prefix|>["not a call"]<|tools_suffix|>', []),
    # granite-20b-fc: <function_call> before each JSON object
    ("granite-20b-fc", 'Let me check. <function_call> {"name": "get_weather", "arguments": '
     '{"city": "Paris"}} <function_call> {"name": "get_time", "arguments": {}}',
     "Let me check.", [_PARIS, _TIME]),
    ("granite-20b-fc", "Paris is sunny.", "Paris is sunny.", []),
    ("granite-20b-fc", '<function_call> {"name": "get_weather", "arguments": {"ratio": -2.5e3'
     ', "tags": []}}', None, [("get_weather", {"ratio": -2500.0, "tags": []})]),
    # granite4: hermes-like tags around each JSON object, text anywhere around them
    ("granite4", 'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
     "</tool_call>", "Checking both.", [_PARIS, _TIME]),
    ("granite4", "Hello there.", "Hello there.", []),
    ("granite4", '<tool_call>\n{"name": "get_weather", "arguments": {"q": "a </tool_call> b\\n'
     '"}}\n</tool_call>\nDone.', "Done.", [("get_weather", {"q": "a </tool_call> b\n"})]),
    ("granite4", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None,
     [("get_weather", {"city": "Pa"})]),
    # ernie45: tagged JSON calls; <response> tags around the answer are not content
    ("ernie45", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
     "</tool_call>\n", "Let me look.", [_PARIS, _TIME]),
    ("ernie45", "<response>It is sunny.</response>", "It is sunny.", []),
    ("ernie45", '<tool_call>\n{"name": "get_weather", "arguments": {"where": {"lat": 1, '
     '"lon": [2, 3]}}}\n</tool_call>', None,
     [("get_weather", {"where": {"lat": 1, "lon": [2, 3]}})]),
    # gigachat3: a "function call" message after <|message_sep|>, or <|function_call|> (3.1)
    ("gigachat3", 'Let me check.<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": '
     '"get_weather", "arguments": {"city": "Paris"}}', "Let me check.", [_PARIS]),
    ("gigachat3", 'One moment.<|function_call|>{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}</s>', "One moment.", [_PARIS]),
    ("gigachat3", 'Two.<|function_call|>{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}<|function_call|>{"name": "get_time", "arguments": {}}', "Two.",
     [_PARIS, _TIME]),
    ("gigachat3", "Hello! How can I help?</s>", "Hello! How can I help?", []),
    ("gigachat3", '<|function_call|>{"name": "get_weather", "arguments": {"note": "line\\n'
     'two \\"q\\""}}', None, [("get_weather", {"note": 'line\ntwo "q"'})]),
    # xlam: a JSON list, whole output or fenced
    ("xlam", '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
     '"arguments": {}}]', None, [_PARIS, _TIME]),
    ("xlam", 'Let me check.\n```json\n[{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}, {"name": "get_time", "arguments": {}}]\n```', "Let me check.",
     [_PARIS, _TIME]),
    ("xlam", "Use ```print(1)``` to print.", "Use ```print(1)``` to print.", []),
    ("xlam", '<tool_call>[{"name": "get_weather", "arguments": {"days": 3}}]</tool_call>',
     None, [("get_weather", {"days": 3})]),
    ("xlam", "[1, 2] is a list.", "[1, 2] is a list.", []),
    # cohere_command3: Command R7B / Command A
    ("cohere_command3", '<|START_THINKING|>I will look up both.<|END_THINKING|>'
     '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
     '{"city": "Paris"}},\n    {"tool_call_id": "1", "tool_name": "get_time", "parameters": '
     "{}}\n]<|END_ACTION|>", None, [_PARIS, _TIME]),
    ("cohere_command3", "Sure.<|START_ACTION|>[\n    {\"tool_call_id\": \"0\", \"tool_name\": "
     "\"get_weather\", \"parameters\": {\"city\": \"Paris\"}}\n]<|END_ACTION|>", "Sure.",
     [_PARIS]),
    ("cohere_command3", "<|START_RESPONSE|>It is sunny.<|END_RESPONSE|>", "It is sunny.", []),
    ("cohere_command3", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
     '"parameters": {"where": {"lat": 1.5}, "tags": ["x\\ty"]', None,
     [("get_weather", {"where": {"lat": 1.5}, "tags": ["x\ty"]})]),
    ("cohere_command3", 'Action:\n```json\n[\n    {\n        "tool_name": "get_weather",\n'
     '        "parameters": {"city": "Paris"}\n    }\n]\n```', None, [_PARIS]),
    ("cohere_command3", "Action: none needed.", "Action: none needed.", []),
    # cohere_command4: Command A's newer templates (text markers too)
    ("cohere_command4", "<|START_TEXT|>It is sunny.<|END_TEXT|>", "It is sunny.", []),
    ("cohere_command4", "Plan first.<|START_ACTION|>[{\"tool_call_id\": \"0\", \"tool_name\": "
     "\"get_weather\", \"parameters\": {\"city\": \"Paris\"}}, {\"tool_call_id\": \"1\", "
     "\"tool_name\": \"get_time\", \"parameters\": {}}]<|END_ACTION|>", "Plan first.",
     [_PARIS, _TIME]),
    # dots: invoke elements in <dots_function_call>, values typed by the tool schema
    ("dots", 'Let me check.\n<dots_function_call>\n<invoke name="get_weather">\n'
     '<parameter name="city">Paris</parameter>\n</invoke>\n<invoke name="get_time">\n'
     "</invoke>\n</dots_function_call>", "Let me check.", [_PARIS, _TIME]),
    ("dots", "No call here.", "No call here.", []),
    ("dots", '<dots_function_call>\n<invoke name="get_weather">\n<parameter name="days"> 3 '
     '</parameter>\n<parameter name="metric">true</parameter>\n<parameter name="ratio">'
     '0.5</parameter>\n<parameter name="tags">["a", "b"]</parameter>\n<parameter '
     'name="city">null</parameter>\n<parameter name="note">42</parameter>\n</invoke>\n'
     "</dots_function_call>", None,
     [("get_weather", {"days": 3, "metric": True, "ratio": 0.5, "tags": ["a", "b"],
                       "city": None, "note": "42"})]),
    ("dots", '<dots_function_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     "</dots_function_call>\nDone.", "Done.", [_PARIS]),
    ("dots", '<dots_function_call>\n<invoke name="get_weather">\n<parameter name="city">'
     "Pa", None, [("get_weather", {"city": "Pa"})]),
    ("dots", "<dots_function_call>nothing</dots_function_call> then",
     "<dots_function_call>nothing</dots_function_call> then", []),
    # minicpm5: <function name=...><param name=...>, CDATA and entities
    ("minicpm5", 'Let me check.\n<function name="get_weather"><param name="city">Paris</param>'
     '</function>\n<function name="get_time"></function>', "Let me check.", [_PARIS, _TIME]),
    ("minicpm5", "Plain answer.", "Plain answer.", []),
    ("minicpm5", '<function name="get_weather"><param name="city"><![CDATA[a < b & c\nd]]>'
     '</param><param name="days">3</param><param name="where">{\'lat\': 1.5}</param>'
     '<param name="note">Tom &amp; Jerry &lt;3</param></function>', None,
     [("get_weather", {"city": "a < b & c\nd", "days": 3, "where": {"lat": 1.5},
                       "note": "Tom & Jerry <3"})]),
    ("minicpm5", '<function name="get_weather"><param name="days">4', None,
     [("get_weather", {"days": 4})]),
    # poolside_v1: <tool_call>NAME then <arg_key>/<arg_value> pairs
    ("poolside_v1", "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
     "<arg_value>Paris</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>",
     "Let me check.", [_PARIS, _TIME]),
    ("poolside_v1", "Just text.", "Just text.", []),
    ("poolside_v1", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>  two words\n"
     "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value><arg_key>tags</arg_key>"
     "<arg_value>['a', None]</arg_value><arg_key>where</arg_key><arg_value>{\"lat\": 1}"
     "</arg_value><arg_key>note</arg_key><arg_value>not json</arg_value></tool_call>", None,
     [("get_weather", {"city": "  two words\n", "days": 3, "tags": ["a", None],
                       "where": {"lat": 1}, "note": "not json"})]),
    ("poolside_v1", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", None,
     [("get_weather", {"city": "Par"})]),
    ("poolside_v1", "a <tool_call> <b> c", "a <tool_call> <b> c", []),
    # lfm2: a Python list between <|tool_call_start|> and <|tool_call_end|>
    ("lfm2", 'Let me check.<|tool_call_start|>[get_weather(city="Paris"), get_time()]'
     "<|tool_call_end|>The weather is sunny.", "Let me check.The weather is sunny.",
     [_PARIS, _TIME]),
    ("lfm2", "It is sunny.", "It is sunny.", []),
    ("lfm2", "<|tool_call_start|>[get_weather(city='it\\'s (x) [y]', days=-3, metric=true, "
     "tags=('a', None), where={'lat': 1.5})]<|tool_call_end|>", None,
     [("get_weather", {"city": "it's (x) [y]", "days": -3, "metric": True,
                       "tags": ["a", None], "where": {"lat": 1.5}})]),
    ("lfm2", '<|tool_call_start|>[get_weather(city="Par', None, [("get_weather", {"city": "Par"})]),
    ("lfm2", "<|tool_call_start|>[1, 2]<|tool_call_end|>", "<|tool_call_start|>[1, 2]"
     "<|tool_call_end|>", []),
    # olmo3: one Python call per line inside <function_calls>
    ("olmo3", 'Checking.\n<function_calls>\nget_weather(city="Paris")\nget_time()\n'
     "</function_calls>", "Checking.", [_PARIS, _TIME]),
    ("olmo3", "No calls.", "No calls.", []),
    ("olmo3", '<function_calls>\nget_weather(city="a\\"b", metric=false, ratio=null, '
     'tags=["x", {"k": [1, 2]}])\n</function_calls>', None,
     [("get_weather", {"city": 'a"b', "metric": False, "ratio": None,
                       "tags": ["x", {"k": [1, 2]}]})]),
    ("olmo3", "<function_calls>\nget_weather(city=\"Oslo\", tags=[1, 2", None,
     [("get_weather", {"city": "Oslo", "tags": [1, 2]})]),
    # plamo3: marked requests, a name and a JSON arguments object each
    ("plamo3", "Let me check." + _P_REQS + _plamo("get_weather", '{"city": "Paris"}')
     + _plamo("get_time", "{}") + _P_REQS_END + "<|plamo:tag|>", "Let me check.",
     [_PARIS, _TIME]),
    ("plamo3", "It is sunny.<|plamo:tag|>", "It is sunny.", []),
    ("plamo3", _P_REQS + _plamo("get_weather", '{"where": {"lat": 1.5}, "q": "\\u00e9\\n"}')
     + _P_REQS_END + "Done.", "Done.", [("get_weather", {"where": {"lat": 1.5}, "q": "é\n"})]),
    ("plamo3", _P_REQS + _P_REQ + _P_NAME + "get_weather" + _P_NAME_END + _P_ARGS
     + '{"city": "Pa', None, [("get_weather", {"city": "Pa"})]),
    # inkling: typed blocks; the output starts in the header of a message the prompt opened
    ("inkling", "<|content_thinking|>Two lookups.<|end_message|><|message_model|>"
     "<|content_text|>Let me check.<|end_message|><|message_model|>"
     '<|content_invoke_tool_json|>{"name": "get_weather", "args": {"city": "Paris"}}'
     "<|end_message|><|message_model|><|content_invoke_tool_json|>"
     '{"name": "get_time", "args": {}}<|end_message|>', "Let me check.", [_PARIS, _TIME]),
    ("inkling", "<|content_text|>It is sunny.<|end_message|>", "It is sunny.", []),
    ("inkling", "get_weather<|content_invoke_tool_json|>{\"name\": \"get_weather\", "
     '"args": {"tags": ["a", {"b": null}], "days": 2}}<|content_model_end_sampling|>', None,
     [("get_weather", {"tags": ["a", {"b": None}], "days": 2})]),
    ("inkling", '<|content_invoke_tool_json|>{"name": "get_weather", "args": {"city": "Os',
     None, [("get_weather", {"city": "Os"})]),
    ("inkling", "Plain text with no block.", "Plain text with no block.", []),
    # gemma4: <|tool_call>call:NAME{key:value,...}<tool_call|>, strings between <|"|>
    ("gemma4", 'Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
     "<|tool_call>call:get_time{}<tool_call|>", "Let me check.", [_PARIS, _TIME]),
    ("gemma4", "I will recall: nothing{} here.", "I will recall: nothing{} here.", []),
    ("gemma4", '<|tool_call>call:get_weather{days:3,metric:true,ratio:-0.5,tags:[<|"|>a, b'
     '<|"|>,null],where:{<|"|>lat<|"|>:1.5,name:<|"|>say "hi"\n<|"|>}}<turn|>', None,
     [("get_weather", {"days": 3, "metric": True, "ratio": -0.5, "tags": ["a, b", None],
                       "where": {"lat": 1.5, "name": 'say "hi"\n'}})]),
    ("gemma4", "Checking. call:get_weather{city:Paris} call:get_time{}", "Checking.",
     [_PARIS, _TIME]),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Par', None,
     [("get_weather", {"city": "Par"})]),
    ("gemma4", "<|tool_call>not a call", "<|tool_call>not a call", []),
    # functiongemma: the same arguments between <start_function_call> markers, <escape>
    ("functiongemma", "Sure.<start_function_call>call:get_weather{city:<escape>Paris<escape>}"
     "<end_function_call><start_function_call>call:get_time{}<end_function_call>", "Sure.",
     [_PARIS, _TIME]),
    ("functiongemma", "call:get_weather{city:Paris} is only text here.",
     "call:get_weather{city:Paris} is only text here.", []),
    ("functiongemma", "<start_function_call>call:get_weather{days:2,tags:[<escape>x{y}<escape>]"
     ",where:{a:{b:false}}}<end_function_call>", None,
     [("get_weather", {"days": 2, "tags": ["x{y}"], "where": {"a": {"b": False}}})]),
    ("functiongemma", "<start_function_call>call:get_weather{days:1", None,
     [("get_weather", {"days": 1})]),
    # openai (gpt-oss harmony): channels and recipients; the prompt opened the first message
    ("openai", "<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant"
     "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>"
     'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
     "<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
     "{}<|call|>", "Let me check.", [_PARIS, _TIME]),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is sunny.<|return|>", "It is sunny.", []),
    ("openai", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"where":{"lat":1.5,"tags":["a\\"b",null]},"days":3}<|call|>', None,
     [("get_weather", {"where": {"lat": 1.5, "tags": ['a"b', None]}, "days": 3})]),
    ("openai", "<|channel|>commentary to=browser.search <|constrain|>json<|message|>"
     '{"q":"x"}<|call|>', None, []),
    ("openai", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city":"Pa', None, [("get_weather", {"city": "Pa"})]),
    ("openai", "Unframed text.", "Unframed text.", []),
    # muse_glimmer: ATEM invokes in messages to a tool; to=self and quoted invokes are not
    ("muse_glimmer", ' to=self<|message|>Quote: <atem:invoke name="get_time"></atem:invoke>'
     "<|eom|><|start|>assistant to=user<|message|>Let me check.<|eom|><|start|>assistant "
     'to=get_weather<|message|><atem:function_calls>\n<atem:invoke name="get_weather">\n'
     '<atem:parameter name="city">Paris</atem:parameter>\n</atem:invoke>\n<atem:invoke '
     'name="get_time">\n</atem:invoke>\n</atem:function_calls><|eom|>', "Let me check.",
     [_PARIS, _TIME]),
    ("muse_glimmer", " to=user<|message|>It is sunny.<|eot|>", "It is sunny.", []),
    ("muse_glimmer", " to=get_weather<|message|><atem:function_calls>\n<atem:invoke "
     'name="get_weather.get_weather">\n<atem:parameter name="days">3</atem:parameter>\n'
     '<atem:parameter name="where">{"lat": 1.5}</atem:parameter>\n<atem:parameter name='
     '"city">"New" York\n</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eom|>',
     None, [("get_weather", {"days": 3, "where": {"lat": 1.5}, "city": '"New" York\n'})]),
    ("muse_glimmer", ' to=get_weather<|message|><atem:function_calls>\n<atem:invoke name="'
     'get_weather">\n<atem:parameter name="city">Par', None,
     [("get_weather", {"city": "Par"})]),
]

# (a real template of llama.cpp's collection, the parser auto-detection must choose)
TEMPLATES_B = [
    ("Apertus-8B-Instruct", "apertus"),
    ("Cohere2MoE", "cohere_command4"),
    ("CohereForAI-c4ai-command-r-plus-tool_use", "cohere_command3"),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "cohere_command3"),
    ("GigaChat3-10B-A1.8B", "gigachat3"),
    ("GigaChat3.1-10B-A1.8B", "gigachat3"),
    ("LFM2-8B-A1B", "lfm2"),
    ("LFM2.5-8B-A1B", "lfm2"),
    ("LFM2.5-Instruct", "lfm2"),
    ("openbmb-MiniCPM5-1B", "minicpm5"),
    ("poolside-Laguna-S-2.1", "poolside_v1"),
    ("poolside-Laguna-XS-2.1", "poolside_v1"),
    ("poolside-Laguna-XS.2", "poolside_v1"),
    ("muse-glimmer", "muse_glimmer"),
    ("openai-gpt-oss-120b", "openai"),
    ("google-gemma-4-31B-it", "gemma4"),
    ("google-gemma-4-31B-it-interleaved", "gemma4"),
    ("ibm-granite-granite-4.0", "granite4"),
    ("ibm-granite-granite-4.1", "granite4"),
    ("fireworks-ai-llama-3-firefunction-v2", "phi4_mini_json"),
    ("microsoft-Phi-3.5-mini-instruct", None),  # renders no tools at all
]
