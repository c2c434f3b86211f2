"""StructuredOutputsParams, the frontend's validation, and the HTTP request fields."""

from __future__ import annotations

import pytest

from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from vllmpy.sampling_params import SamplingParams, StructuredOutputsParams
from vllmpy.structured_output import validate_structured_outputs
from vllmpy.structured_output.backend_xgrammar import choice_ebnf, error_text
from vllmpy.structured_output.schema_check import check_json_schema

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


# ---- StructuredOutputsParams ------------------------------------------------------------


@pytest.mark.parametrize("kwargs, needle", [
    ({}, "got none"),
    ({"json": SCHEMA, "regex": "a+"}, "got json, regex"),
    ({"json_object": False}, "got none"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty list"),
    ({"choice": "ab"}, "non-empty list"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": 5}, "grammar must be a non-empty string"),
    ({"json": 3}, "JSON Schema object or its JSON text"),
    ({"json_object": "yes"}, "json_object must be a boolean"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a boolean"),
])
def test_params_need_exactly_one_well_formed_constraint(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        StructuredOutputsParams(**kwargs)


def test_params_kind_and_key():
    p = StructuredOutputsParams(json=SCHEMA)
    assert p.kind == "json"
    # the same schema as an object or as JSON text compiles once
    assert p.key() == StructuredOutputsParams(json='{"type": "object", "properties": '
                                                   '{"a": {"type": "integer"}}, '
                                                   '"required": ["a"]}').key()
    assert p.key() != StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).key()
    assert StructuredOutputsParams(choice=["x", "y"]).key() != \
        StructuredOutputsParams(choice=["y", "x"]).key()
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_sampling_params_take_a_dict_and_refuse_other_types():
    sp = SamplingParams(structured_outputs={"regex": "a+"})  # type: ignore[arg-type]
    assert sp.structured_outputs == StructuredOutputsParams(regex="a+")
    assert sp.clone().structured_outputs == sp.structured_outputs
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")  # type: ignore[arg-type]


# ---- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("params, needle", [
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(json={"type": "strin"}), 'Unsupported type "strin"'),
    (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "missing"),
    (StructuredOutputsParams(json={"type": "string", "pattern": "(("}), "parenthesis"),
    (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"},
                                   "uniqueItems": True}), "'uniqueItems': true"),
    (StructuredOutputsParams(regex="a("), "invalid regex"),
    (StructuredOutputsParams(grammar='root ::= "a'), "invalid grammar"),
    (StructuredOutputsParams(grammar='start ::= "a"'), 'root rule with name "root"'),
])
def test_validation_names_the_problem(params, needle):
    with pytest.raises(ValueError, match=needle) as info:
        validate_structured_outputs(params)
    assert ".cc:" not in str(info.value)  # no C++ source locations for users


def test_validation_accepts_good_constraints_and_needs_a_tokenizer():
    for params in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"\d+"),
                   StructuredOutputsParams(choice=['say "hi"', "a\\b"]),
                   StructuredOutputsParams(grammar='root ::= "x" | "y"'),
                   StructuredOutputsParams(json_object=True)):
        validate_structured_outputs(params)
    validate_structured_outputs(None, has_tokenizer=False)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        validate_structured_outputs(StructuredOutputsParams(regex="a"), has_tokenizer=False)


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_ebnf(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def test_error_text_drops_the_source_location():
    err = RuntimeError("[15:00:29] /project/cpp/json_schema_converter.cc:5082: Unsupported "
                       "type \"x\"\n")
    assert error_text(err) == 'Unsupported type "x"'


@pytest.mark.parametrize("schema, needle", [
    ({"not": {"type": "string"}}, "'not' is not supported (at #)"),
    ({"type": "object", "properties": {"a/b": {"if": {}}}},
     "'if'/'then'/'else' are not supported (at #/properties/a~1b)"),
    ({"type": "array", "items": {"type": "array", "contains": {}}}, "'contains'"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
    ({"anyOf": [{"type": "integer"}, {"$ref": "http://x/y.json"}]},
     "'$ref': 'http://x/y.json' is not supported: only references inside"),
    ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 3},
     "keywords beside '$ref' (minimum)"),
    ({"maxLength": 3}, "'maxLength' without 'type'"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' is supported only"),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "'allOf' with more than one"),
    ({"type": "array", "items": [{"type": "integer"}]}, "'items' as a list"),
    ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties'"),
    ({"$defs": {"n": {"type": "object", "properties": {"x": {"not": {}}}}}},
     "(at #/$defs/n/properties/x)"),
    ({"type": "object", "properties": {"a": 3}}, "must be an object or a boolean"),
    ({"oneOf": [True, True]}, "'oneOf' whose alternatives may overlap"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' whose alternatives"),
    ({"oneOf": [{"type": "string"}, {}]}, "'oneOf' whose alternatives"),
    ({"oneOf": [{"enum": [1, 2]}, {"const": 2}]}, "'oneOf' whose alternatives"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}},
                {"type": "object", "properties": {"k": {"const": "b"}}}]},
     "'oneOf' whose alternatives"),  # k is not required: {} matches both
])
def test_unenforceable_schema_keywords_are_refused_by_name(schema, needle):
    with pytest.raises(ValueError, match="cannot be enforced|must be an object") as info:
        check_json_schema(schema)
    assert needle in str(info.value)


@pytest.mark.parametrize("schema", [
    True,
    {"type": "integer", "multipleOf": 3},
    {"type": "array", "items": {"type": "string"}, "uniqueItems": False},
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"const": 1}}},
    {"type": "object", "properties": {"e": {"enum": [{"not": 1}]}}},  # data, not a schema
    {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "description": "d"},
    {"allOf": [{"type": "integer"}]},
    {"type": "string", "format": "date"},
    {"oneOf": [{"type": "integer"}, {"type": ["string", "null"]}]},
    {"oneOf": [{"const": 1}, {"enum": [2, "1"]}, {"type": "boolean"}]},
    {"$defs": {"cat": {"type": "object", "properties": {"kind": {"const": "cat"}},
                       "required": ["kind"]},
               "dog": {"type": "object", "properties": {"kind": {"const": "dog"}},
                       "required": ["kind"]}},
     "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]},  # a discriminated union
])
def test_enforceable_schemas_pass(schema):
    check_json_schema(schema)


# ---- the HTTP request fields ------------------------------------------------------------


def completion(**body):
    return parse_request(CompletionRequest, {"prompt": "x", **body})


def chat(**body):
    return parse_request(ChatCompletionRequest,
                         {"messages": [{"role": "user", "content": "x"}], **body})


@pytest.mark.parametrize("make", [completion, chat])
@pytest.mark.parametrize("body, expected", [
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "[a-z]+"}, StructuredOutputsParams(regex="[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"structured_outputs": {"choice": ["x"], "disable_fallback": True}},
     StructuredOutputsParams(choice=["x"])),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": None}, None),
])
def test_request_fields_become_structured_outputs(make, body, expected):
    assert make(**body).to_sampling_params().structured_outputs == expected


@pytest.mark.parametrize("body, param, needle", [
    ({"guided_json": {"type": "strin"}}, "guided_json",
     'guided_json: invalid JSON schema: Unsupported type "strin"'),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "n", "schema": {"not": {}}}}},
     "response_format", "response_format: the JSON schema cannot be enforced: 'not'"),
    ({"guided_regex": "(", "guided_choice": ["a"]}, "guided_choice",
     "got guided_regex and guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "got response_format and structured_outputs"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs",
     "structured_outputs has no field 'bogus'"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "structured_outputs.whitespace_pattern is not supported"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of json"),
    ({"structured_outputs": "a"}, "structured_outputs", "must be an object"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar", "invalid grammar"),
])
def test_bad_structured_fields_are_400s_naming_them(body, param, needle):
    with pytest.raises(OpenAIError) as info:
        chat(**body).to_sampling_params()
    assert info.value.status_code == 400
    assert info.value.param == param
    assert needle in info.value.message, info.value.message


@pytest.mark.parametrize("response_format, needle", [
    ({"type": "json_schema"}, "needs a 'json_schema' object with a 'name'"),
    ({"type": "json_schema", "json_schema": {"name": "n"}}, "needs json_schema.schema"),
    ({"type": "structural_tag"}, "'structural_tag' is not supported yet"),
    ({"type": "yaml"}, "response_format must be"),
])
def test_malformed_response_format_is_refused(response_format, needle):
    for make in (completion, chat):
        with pytest.raises(OpenAIError) as info:
            make(response_format=response_format)
        assert info.value.param == "response_format"
        assert needle in info.value.message


def test_guided_whitespace_pattern_is_refused():
    with pytest.raises(OpenAIError) as info:
        completion(guided_json=SCHEMA, guided_whitespace_pattern=" ")
    assert info.value.param == "guided_whitespace_pattern"


def test_enable_jump_forward_flag_is_an_engine_arg_off_by_default():
    import argparse

    from vllmpy.config import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).enable_jump_forward is False
    args = EngineArgs.from_cli_args(parser.parse_args(["--enable-jump-forward"]))
    assert args.enable_jump_forward is True


def test_structured_outputs_survive_the_trip_to_the_engine_core_process():
    from vllmpy.engine.core import EngineCoreRequest
    from vllmpy.engine.core_proc import AddRequestMsg, add_decoder, encoder

    # property order matters (it is the generation order) and must survive msgpack
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    sent = SamplingParams(structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    msg = AddRequestMsg.from_request(EngineCoreRequest("r", [1, 2], sent, 5, 0.0))
    got = add_decoder.decode(encoder.encode(msg)).to_request().sampling_params
    assert got.structured_outputs is not None and sent.structured_outputs is not None
    assert got.structured_outputs == sent.structured_outputs
    assert got.structured_outputs.key() == sent.structured_outputs.key()
