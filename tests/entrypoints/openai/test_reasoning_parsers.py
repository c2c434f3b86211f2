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
from vllmpy.loader.pypi_weights import fetch
from vllmpy.reasoning import REASONING_PARSERS, detect_reasoning_parser, get_reasoning_parser
from vllmpy.sampling_params import SamplingParams
from vllmpy.tokenizer.chat_template import normalize_messages, render_chat_template

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
    # holo2: deepseek_v3 with thinking on unless `thinking` or `enable_thinking` is given
    ("holo2", {}, "Let me look.\n</think>\n\nThe button is at the top.", "Let me look.\n",
     "The button is at the top."),
    ("holo2", {}, "Still looking", "Still looking", ""),
    ("holo2", {}, "<think>x</think>y", "x", "y"),
    ("holo2", {"chat_template_kwargs": {"thinking": False}}, "Direct.</think>", "",
     "Direct.</think>"),
    ("holo2", {"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": False}},
     "Hi.", "", "Hi."),
    ("holo2", {"enable_thinking": True,
               "chat_template_kwargs": {"thinking": False, "enable_thinking": True}},
     "a</think>b", "a", "b"),
    ("holo2", {"prompt_tail": CLOSED}, "Answer.", "", "Answer."),
    ("holo2", {"prompt_tail": OPENED, "chat_template_kwargs": {"thinking": False}},
     "a</think>b", "a", "b"),
]

MM_OPENED = "]~b]ai\n<think>\n"  # MiniMax-M2's generation prompt
MM_CALL = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
           '</parameter>\n</invoke>\n</minimax:tool_call>')
VECTORS += [
    # minimax_m2: reasoning until </think> or a tool call; <think> inside it dropped; a
    # stray </think> in the content dropped outside tool calls
    ("minimax_m2", {"prompt_tail": MM_OPENED}, "The user wants 2+2.\n</think>\n\nIt is 4.",
     "The user wants 2+2.\n", "It is 4."),
    ("minimax_m2", {}, "</think>\n\nJust the answer.", "", "Just the answer."),
    ("minimax_m2", {}, "thinking, then the length limit", "thinking, then the length limit", ""),
    ("minimax_m2", {"prompt_tail": MM_OPENED + "</think>\n\n"}, "It is 4.", "", "It is 4."),
    ("minimax_m2", {}, "Need the weather.\n" + MM_CALL, "Need the weather.\n", MM_CALL),
    ("minimax_m2", {}, "<think>\nHmm.<think></think>Ok", "\nHmm.", "Ok"),
    ("minimax_m2", {}, 'r</think>A</think>B<minimax:tool_call><invoke name="f"><parameter '
     'name="x"></think></parameter></invoke></minimax:tool_call></think>C', "r",
     'AB<minimax:tool_call><invoke name="f"><parameter name="x"></think></parameter>'
     '</invoke></minimax:tool_call>C'),
    ("minimax_m2", {}, "r</think>Use <think> tags.", "r", "Use <think> tags."),
    ("minimax_m2", {}, "r</think>x<minimax:tool_call>cut", "r", "x<minimax:tool_call>cut"),
    # minimax_m2_append_think: all content, the prompt's <think> written back in front
    ("minimax_m2_append_think", {"prompt_tail": MM_OPENED}, "Adding.\n</think>\n\n4", "",
     "<think>Adding.\n</think>\n\n4"),
    ("minimax_m2_append_think", {}, "Still going", "", "<think>Still going"),
    ("minimax_m2_append_think", {}, "", "", "<think>"),
    ("minimax_m2_append_think", {}, "a</think>\n" + MM_CALL, "",
     "<think>a</think>\n" + MM_CALL),
    # step3: reasoning up to the first </think>, taken as written
    ("step3", {"prompt_tail": "<|BOT|>assistant\n<think>\n"}, "Compute 2+2.\n</think>\n4",
     "Compute 2+2.\n", "4"),
    ("step3", {}, "</think>Just this.", "", "Just this."),
    ("step3", {}, "no end marker yet", "no end marker yet", ""),
    ("step3", {}, "<think>a</think>b", "<think>a", "b"),
    ("step3", {}, "a</think>b</think>c", "a", "b</think>c"),
    ("step3", {"prompt_tail": "<|BOT|>assistant\n<think>\n</think>\n"}, "Plain.", "",
     "Plain."),
    # olmo3: reasoning before the first </think>, with or without <think>; no </think> and
    # no open block is content, verbatim
    ("olmo3", {}, "<think>Two plus two.</think>\n\nFour.", "Two plus two.", "Four."),
    ("olmo3", {}, "Two plus two.</think>Four.", "Two plus two.", "Four."),
    ("olmo3", {}, "Four, since 2+2=4.", "", "Four, since 2+2=4."),
    ("olmo3", {}, "  Four.", "", "  Four."),
    ("olmo3", {}, "<think>Still thinking", "Still thinking", ""),
    ("olmo3", {"prompt_tail": OPENED}, "Still thinking", "Still thinking", ""),
    ("olmo3", {"prompt_tail": OPENED}, "Two plus two.</think>Four.", "Two plus two.", "Four."),
    ("olmo3", {"prompt_tail": CLOSED}, "a</think>b", "", "a</think>b"),
    ("olmo3", {}, "a</think>b</think>c", "a", "b</think>c"),
]

ATEM_CALL = ('<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter '
             'name="city">Paris</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')
VECTORS += [
    # muse_glimmer: to=self bodies are reasoning, to=user bodies content, a tool channel
    # and all after it content as written
    ("muse_glimmer", {}, " to=self<|message|>The user greets me.<|eom|><|start|>assistant "
     "to=user<|message|>Hello!<|eot|>", "The user greets me.", "Hello!"),
    ("muse_glimmer", {}, " to=user<|message|>Hi.<|eot|>", "", "Hi."),
    ("muse_glimmer", {}, "<|message|>Bare header.<|eot|>", "", "Bare header."),
    ("muse_glimmer", {}, "Plain text.", "", "Plain text."),
    ("muse_glimmer", {}, "to", "", "to"),
    ("muse_glimmer", {}, " to=self<|message|>Thinking about to", "Thinking about to", ""),
    ("muse_glimmer", {}, " to=self<|message|>A<|eom|><|start|>assistant", "A", ""),
    ("muse_glimmer", {}, " to=self<|message|>Need the weather.<|eom|><|start|>assistant "
     "to=get_weather<|message|>" + ATEM_CALL + "<|eom|>", "Need the weather.",
     "to=get_weather<|message|>" + ATEM_CALL + "<|eom|>"),
    ("muse_glimmer", {}, " to=self<|message|>Call it. to=get_weather<|message|>" + ATEM_CALL,
     "Call it. ", "to=get_weather<|message|>" + ATEM_CALL),
    ("muse_glimmer", {}, " to=self<|message|>A<|eom|><|start|>assistant to=self<|message|>B"
     "<|eom|><|start|>assistant to=user<|message|>C<|eot|>", "A\nB", "C"),
    ("muse_glimmer", {}, " to=self<|message|>Go to the store, to=x later<|eom|>"
     "<|start|>assistant to=user<|message|>Done<|eot|>", "Go to the store, to=x later", "Done"),
    ("muse_glimmer", {}, " to=self<|message|>A<|start|>assistant to=user<|message|>B", "A", "B"),
    ("muse_glimmer", {}, " to=self<|message|>a <|message|> b<|eom|>", "a <|message|> b", ""),
    ("muse_glimmer", {}, "Hello <|start|>assistant to=user<|message|>Hi<|eot|>", "",
     "Hello Hi"),
    ("muse_glimmer", {}, "A<|start|>B C", "", "AB C"),
    ("muse_glimmer", {"prompt_tail": "<|start|>assistant to=self<|message|>"},
     "x<|eom|><|start|>assistant to=user<|message|>y", "x", "y"),
]


def cut_sets(text: str) -> list[list[int]]:
    if len(text) < 2:
        return [[]]
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


# What `--reasoning-parser auto` must choose for each of llama.cpp's real chat templates,
# read off the markers each one writes: a generic <think> block (written into the prompt,
# switched by a variable, or only stripped from past turns) is think_auto, never qwen3;
# [THINK] is mistral; MiniMax-M2's <think> beside <minimax:tool_call> is minimax_m2; Muse
# Glimmer's to=self channel is muse_glimmer. Families whose markers none of the parsers
# reads (<seed:think>, <|START_THINKING|>, <|channel|>, <|think|>, <mm:think>, ...) and
# templates with no thinking markers are None.
TEMPLATE_PARSERS: dict[str, str | None] = {
    "Apertus-8B-Instruct.jinja": None,  # <|inner_prefix|> deliberation tokens
    "Apriel-1.6-15b-Thinker-fixed.jinja": None,  # [BEGIN FINAL RESPONSE]
    "Bielik-11B-v3.0-Instruct.jinja": "think_auto",
    "ByteDance-Seed-OSS.jinja": None,  # <seed:think>
    "Cohere2MoE.jinja": None,  # <|START_THINKING|>
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": None,
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": None,  # <|START_THINKING|>
    "GLM-4.6.jinja": "think_auto",
    "GLM-4.7-Flash.jinja": "think_auto",
    "GigaChat3-10B-A1.8B.jinja": None,
    "GigaChat3.1-10B-A1.8B.jinja": None,
    "HuggingFaceTB-SmolLM3-3B.jinja": "think_auto",
    "Kimi-K2-Instruct.jinja": None,
    "Kimi-K2-Thinking.jinja": "think_auto",
    "Kimi-K3.jinja": None,  # <|open|>think
    "LFM2-8B-A1B.jinja": None,
    "LFM2.5-8B-A1B.jinja": "think_auto",
    "LFM2.5-Instruct.jinja": "think_auto",  # strips </think> blocks from past turns
    "MiMo-VL.jinja": None,
    "MiniMax-M1.jinja": None,
    "MiniMax-M2.jinja": "minimax_m2",
    "MiniMax-M3.jinja": None,  # <mm:think>
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": None,
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "think_auto",
    "NVIDIA-Nemotron-Nano-v2.jinja": "think_auto",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": None,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": None,
    "Qwen-QwQ-32B.jinja": "think_auto",
    "Qwen-Qwen2.5-7B-Instruct.jinja": None,
    "Qwen-Qwen3-0.6B.jinja": "think_auto",
    "Qwen3-Coder.jinja": None,
    "Qwen3.5-4B.jinja": "think_auto",
    "Reka-Edge.jinja": "think_auto",
    "Spark2.5.jinja": "think_auto",
    "StepFun3.5-Flash.jinja": "think_auto",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "think_auto",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "think_auto",
    "deepseek-ai-DeepSeek-V3.1.jinja": "think_auto",
    "deepseek-ai-DeepSeek-V3.2.jinja": "think_auto",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "think_auto",
    "deepseek-ai-DeepSeek-V4.jinja": "think_auto",
    "fireworks-ai-llama-3-firefunction-v2.jinja": None,
    "google-gemma-2-2b-it.jinja": None,
    "google-gemma-4-31B-it-interleaved.jinja": None,  # <|think|>, <|channel>thought
    "google-gemma-4-31B-it.jinja": None,
    "ibm-granite-granite-3.3-2B-Instruct.jinja": "think_auto",
    "ibm-granite-granite-4.0.jinja": None,
    "ibm-granite-granite-4.1.jinja": None,
    "inclusionai-ling-3.0-flash.jinja": "think_auto",
    "llama-cpp-deepseek-r1.jinja": "think_auto",
    "llama-cpp-rwkv-world.jinja": "think_auto",
    "meetkai-functionary-medium-v3.1.jinja": None,
    "meetkai-functionary-medium-v3.2.jinja": None,
    "meta-llama-Llama-3.1-8B-Instruct.jinja": None,
    "meta-llama-Llama-3.2-3B-Instruct.jinja": None,
    "meta-llama-Llama-3.3-70B-Instruct.jinja": None,
    "microsoft-Phi-3.5-mini-instruct.jinja": None,
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": None,
    "moonshotai-Kimi-K2.jinja": None,
    "muse-glimmer.jinja": "muse_glimmer",
    "openai-gpt-oss-120b.jinja": None,  # <|channel|>analysis
    "openbmb-MiniCPM5-1B.jinja": "think_auto",
    "poolside-Laguna-S-2.1.jinja": "think_auto",
    "poolside-Laguna-XS-2.1.jinja": "think_auto",
    "poolside-Laguna-XS.2.jinja": "think_auto",
    "tencent-Hy3.jinja": None,  # <think｜...> spelled with its own token
    "unsloth-Apriel-1.5.jinja": None,  # <thinking>
    "unsloth-mistral-Devstral-Small-2507.jinja": None,
    "upstage-Solar-Open-100B.jinja": None,  # <|think|>
}


@pytest.fixture(scope="module")
def template_dir():
    return fetch("llama.cpp-models") / "templates"


def test_the_table_covers_every_template(template_dir):
    assert sorted(p.name for p in template_dir.glob("*.jinja")) == sorted(TEMPLATE_PARSERS)


@pytest.mark.parametrize("name", sorted(TEMPLATE_PARSERS))
def test_auto_detection_on_real_templates(name, template_dir):
    template = (template_dir / name).read_text(encoding="utf-8")
    assert detect_reasoning_parser(template) == TEMPLATE_PARSERS[name]


# The auto-chosen parser reading the prompt that the real template renders: whether the
# template opened a thinking block, closed one, or left the model to open its own.
RENDERED = [
    ("MiniMax-M2.jinja", {}, "Adding.</think>4", ("Adding.", "4")),
    ("MiniMax-M2.jinja", {}, "cut short", ("cut short", "")),
    ("Qwen-Qwen3-0.6B.jinja", {"enable_thinking": False}, "Hi.", ("", "Hi.")),
    ("Qwen-Qwen3-0.6B.jinja", {"enable_thinking": True}, "<think>a</think>b", ("a", "b")),
    ("Qwen-Qwen3-0.6B.jinja", {"enable_thinking": True}, "Hi.", ("", "Hi.")),
    ("GLM-4.7-Flash.jinja", {}, "a</think>b", ("a", "b")),
    ("GLM-4.7-Flash.jinja", {"enable_thinking": False}, "b", ("", "b")),
    # this copy closes the block it opens unless enable_thinking is set
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", {}, "a</think>b", ("", "a</think>b")),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", {"enable_thinking": True}, "a</think>b",
     ("a", "b")),
    ("StepFun3.5-Flash.jinja", {}, "a\n</think>\nb", ("a\n", "b")),
    ("muse-glimmer.jinja", {}, " to=self<|message|>a<|eom|><|start|>assistant to=user"
     "<|message|>b<|eot|>", ("a", "b")),
]


@pytest.mark.parametrize("name, kwargs, text, expected", RENDERED,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(RENDERED)])
def test_auto_parser_reads_the_rendered_prompt(name, kwargs, text, expected, template_dir):
    template = (template_dir / name).read_text(encoding="utf-8")
    prompt = render_chat_template(template, [{"role": "user", "content": "2+2?"}],
                                  chat_template_kwargs=kwargs)
    parser_name = detect_reasoning_parser(template)
    assert parser_name == TEMPLATE_PARSERS[name]
    cls = get_reasoning_parser(parser_name)
    make = lambda: cls(prompt_tail=prompt[-64:], chat_template_kwargs=kwargs)  # noqa: E731
    assert run(make(), text, []) == expected
    for cuts in cut_sets(text)[::5]:
        assert run(make(), text, cuts) == expected, cuts


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


@pytest.mark.parametrize("name, keeps", [
    ("muse_glimmer", True),  # <|start|>, <|message|>, <|eom|>, <|eot|> are special tokens
    ("mistral", True),
    ("olmo3", False),  # its <think> and </think> are ordinary text
    ("minimax_m2", False),
])
def test_reasoning_markers_that_are_special_tokens_keep_them(name, keeps):
    params = SamplingParams()
    plan(request(), None, name).apply(params)
    assert params.skip_special_tokens is (not keeps)


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


MUSE = (" to=self<|message|>The user wants the weather.<|eom|><|start|>assistant to=user"
        "<|message|>Let me check.<|eom|><|start|>assistant to=get_weather<|message|>"
        '<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter '
        'name="city">Paris</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eom|>')


def test_a_channel_format_keeps_the_answer_before_its_call():
    """muse_glimmer as both parsers: the reasoning parser gives reasoning_content, the tool
    parser reads the whole framed output, so the answer written before the call stays."""
    message, reason = plan(request(tools=TOOLS), "muse_glimmer", "muse_glimmer").message(
        MUSE, "stop")
    assert message.reasoning_content == "The user wants the weather."
    assert message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] \
        == [("get_weather", {"city": "Paris"})]
    assert reason == "tool_calls"
