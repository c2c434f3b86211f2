"""Generation under constraints with the real SmolLM2 model: one batch of JSON schemas
(hand-written plus the JSON-Schema test suite's), regexes, choice lists and grammars, all
in one ``LLM.chat`` call, greedy. Every finished output must satisfy its constraint, judged
by independent checkers (jsonschema, re, json, ast)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import jsonschema
import pytest
from structured_output.schema_suite import suite_schemas

from vllmpy import SamplingParams
from vllmpy.sampling_params import StructuredOutputsParams
from vllmpy.structured_output import validate_structured_outputs

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
SUITE_PER_FILE = 2  # schemas taken from each file of the test suite

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"]}
HAND_WRITTEN: list[Any] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0,
                                              "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "boolean"},
    {"type": "integer", "minimum": 1, "maximum": 10},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
     "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2},
    {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30},
                                      "city": {"type": "string", "maxLength": 20},
                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
     "required": ["street", "city", "zip"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 2}}, "required": ["id", "tags"]}},
     "required": ["user"]},
    {"$defs": {"point": POINT}, "type": "object",
     "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
     "required": ["a", "b"]},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
    {"type": ["string", "null"], "maxLength": 10},
    {"type": "object", "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
     "required": ["version", "ok"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"}},
     "required": ["date"]},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 10},
                                      {"type": "integer"}], "items": False},
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    {"type": "object", "properties": {"a": {"type": "integer"},
                                      "b": {"type": "string", "maxLength": 5}},
     "required": ["a"]},
    {"type": "string", "format": "uuid"},
    {"type": "string", "minLength": 3, "maxLength": 6},
    {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["value"]}},
     "$ref": "#/$defs/node"},
    {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    {"type": "array", "items": POINT, "maxItems": 2},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                      "confidence": {"type": "integer", "minimum": 0,
                                                     "maximum": 100}},
     "required": ["answer", "confidence"]},
]

REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{1,20}\.",
           r"[A-Z][a-z]+ [A-Z][a-z]+", r"#[0-9a-f]{6}", r"\d{4}-\d{2}-\d{2}"]
CHOICES = [["positive", "negative"], ["Paris", "London", "Berlin"], ["A", "B", "C", "D"],
           ['say "yes"', "say no"]]
ARITHMETIC = """
root ::= operand op operand (op operand)?
operand ::= [1-9] [0-9]? | "(" operand op operand ")"
op ::= " + " | " - " | " * "
"""
WORD_LIST = """
root ::= "[" item ("," item)* "]"
item ::= "\\"" [a-z]+ "\\""
"""
GRAMMARS = [(ARITHMETIC, "Write an arithmetic expression."),
            (WORD_LIST, "List three fruits as a JSON array."),
            ('root ::= ("ha")+ "!"', "Laugh.")]


def bounded(schema: Any) -> bool:
    """Whether every value the schema allows is spelled out by a type, enum, const or
    reference, with numbers capped: a small model writing it greedily is likely to stop
    (an empty schema lets it ramble on until max_tokens)."""
    if not isinstance(schema, dict):
        return False
    if not any(k in schema for k in ("type", "enum", "const", "$ref", "anyOf", "oneOf",
                                     "allOf")):
        return False
    if (schema.get("type") in ("integer", "number")
            and not any(k in schema for k in ("maximum", "exclusiveMaximum", "enum"))):
        return False
    subschemas = [*(schema.get("properties") or {}).values(),
                  *(schema.get("patternProperties") or {}).values(),
                  *(schema.get("$defs") or {}).values(),
                  *(sub for key in ("anyOf", "oneOf", "allOf", "prefixItems")
                    for sub in schema.get(key) or []),
                  *(schema[key] for key in ("items", "additionalProperties")
                    if schema.get(key) not in (None, False))]
    return all(bounded(sub) for sub in subschemas)


def suite_selection() -> list[Any]:
    """Up to SUITE_PER_FILE schemas from each file of the suite that the backend accepts
    (its refusals are tested elsewhere), bounded ones first; boolean schemas are left
    out."""
    by_file: dict[str, list[Any]] = {}
    for stem, _, schema in suite_schemas():
        if isinstance(schema, bool):
            continue
        try:
            validate_structured_outputs(StructuredOutputsParams(json=schema))
        except ValueError:
            continue
        by_file.setdefault(stem, []).append(schema)
    chosen = []
    for schemas in by_file.values():
        ranked = sorted(schemas, key=lambda s: not bounded(s))  # stable: file order kept
        chosen.extend(ranked[:SUITE_PER_FILE])
    return chosen


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def batch(llm):
    """Every constrained prompt, generated in one call: (kind, spec, output) triples."""
    jobs: list[tuple[str, Any, list[dict[str, str]], StructuredOutputsParams]] = []
    # the suite's schemas are written without whitespace (disable_any_whitespace)
    for schema, compact in [(s, False) for s in HAND_WRITTEN] + \
            [(s, True) for s in suite_selection()]:
        jobs.append(("json", schema,
                     ask(f"Reply with JSON that matches this JSON Schema:\n{json.dumps(schema)}"),
                     StructuredOutputsParams(json=schema, disable_any_whitespace=compact)))
    for pattern in REGEXES:
        jobs.append(("regex", pattern, ask(f"Write text matching the regex {pattern}"),
                     StructuredOutputsParams(regex=pattern)))
    for options in CHOICES:
        jobs.append(("choice", options, ask(f"Pick one of: {', '.join(options)}."),
                     StructuredOutputsParams(choice=options)))
    for grammar, question in GRAMMARS:
        jobs.append(("grammar", grammar, ask(question), StructuredOutputsParams(grammar=grammar)))
    jobs.append(("json_object", None, ask("Describe a cat as a JSON object."),
                 StructuredOutputsParams(json_object=True)))
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so)
              for *_, so in jobs]
    outputs = llm.chat([conv for _, _, conv, _ in jobs], params, use_tqdm=False)
    assert len(outputs) == len(jobs)
    return [(kind, spec, out.outputs[0]) for (kind, spec, _, _), out in zip(jobs, outputs)]


def finished(batch, kind):
    done = [(spec, c.text) for k, spec, c in batch if k == kind and c.finish_reason == "stop"]
    total = sum(1 for k, *_ in batch if k == kind)
    return done, total


def test_json_schema_outputs_validate(batch):
    done, total = finished(batch, "json")
    assert total >= 50
    # open-ended schemas may run to max_tokens; most must finish
    assert len(done) >= 0.5 * total, f"only {len(done)} of {total} outputs finished"
    for schema, text in done:
        jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator)


def test_regex_outputs_match(batch):
    done, total = finished(batch, "regex")
    assert len(done) == total
    for pattern, text in done:
        assert re.fullmatch(pattern, text), (pattern, text)


def test_choice_outputs_are_one_of_the_choices(batch):
    done, total = finished(batch, "choice")
    assert len(done) == total
    for options, text in done:
        assert text in options


def test_grammar_outputs_parse(batch):
    done, total = finished(batch, "grammar")
    assert len(done) == total
    texts = {grammar: text for grammar, text in done}
    tree = ast.parse(texts[ARITHMETIC], mode="eval")  # an arithmetic expression
    assert all(isinstance(node, (ast.Expression, ast.BinOp, ast.Constant, ast.operator))
               for node in ast.walk(tree)), texts[ARITHMETIC]
    words = json.loads(texts[WORD_LIST])
    assert words and all(re.fullmatch("[a-z]+", w) for w in words)
    assert re.fullmatch("(ha)+!", texts[GRAMMARS[2][0]])


def test_json_object_output_is_json(batch):
    for _, _, c in (b for b in batch if b[0] == "json_object"):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), (dict, list))
        else:
            assert c.text.lstrip()[:1] in ("{", "[")
