"""Structured output over HTTP, through the openai SDK against a real server (SmolLM2)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Ada", "Alan", "Grace"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes_tea": {"type": "boolean"},
    },
    "required": ["name", "age", "likes_tea"],
}


def chat(server, **kwargs):
    return server.client().chat.completions.create(
        model=kwargs.pop("model", None) or server_model(server),
        messages=kwargs.pop("messages", [{"role": "user", "content": "Describe a person."}]),
        temperature=0, max_tokens=kwargs.pop("max_tokens", 48), **kwargs)


def server_model(server) -> str:
    return server.client().models.list().data[0].id


def test_response_format_json_schema_is_followed(server):
    r = chat(server, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object_gives_json(server):
    r = chat(server, response_format={"type": "json_object"}, max_tokens=24,
             messages=[{"role": "user", "content": "Give a JSON object with one key, a."}])
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), (dict, list))
    else:  # cut by max_tokens: still a prefix of JSON, starting with an object or array
        assert choice.message.content.lstrip()[:1] in ("{", "[")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_guided_choice_picks_one_of_the_choices(server, endpoint):
    choices = ["positive", "negative", "neutral"]
    client = server.client()
    question = "Is the sentence 'I love this film' positive, negative or neutral?"
    if endpoint == "chat":
        r = chat(server, messages=[{"role": "user", "content": question}],
                 extra_body={"guided_choice": choices})
        text = r.choices[0].message.content
    else:
        r = client.completions.create(model=server_model(server), prompt=question + " Answer:",
                                      temperature=0, max_tokens=8,
                                      extra_body={"guided_choice": choices})
        text = r.choices[0].text
    assert text in choices
    assert r.choices[0].finish_reason == "stop"


def test_structured_outputs_regex_streams_a_match(server):
    pattern = r"[0-9]{3}-[0-9]{4}"
    stream = server.client().completions.create(
        model=server_model(server), prompt="A phone number:", temperature=0, max_tokens=16,
        stream=True, extra_body={"structured_outputs": {"regex": pattern}})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", 'invalid JSON schema: Unsupported type "strin"'),
    ({"extra_body": {"guided_json": {"type": "array", "items": {"type": "integer"},
                                     "uniqueItems": True}}},
     "guided_json", "'uniqueItems': true is not supported"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "invalid regex"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice",
     "got guided_regex and guided_choice"),
])
def test_an_invalid_constraint_is_a_400_naming_the_problem(server, body, param, needle):
    with pytest.raises(openai.BadRequestError) as info:
        chat(server, **body)
    error = info.value.body
    assert isinstance(error, dict)
    assert needle in error["message"], error
    assert error["param"] == param
    assert info.value.status_code == 400
