"""OpenAI request validation, the request -> SamplingParams mapping, the error shape, and
response bodies checked against the OpenAI schema's required fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from vllmpy.entrypoints.openai.errors import (
    OpenAIError,
    error_body,
    validation_error_to_openai,
)
from vllmpy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    PromptTokenUsageInfo,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    ToolCall,
    UsageInfo,
    parse_request,
    parse_tokenize_request,
    random_id,
)
from vllmpy.sampling_params import RequestOutputKind

USER = [{"role": "user", "content": "hi"}]


def refusal(cls: type, body: dict[str, Any]) -> OpenAIError:
    """The 400 a body gets, whether validation or conversion refuses it."""
    with pytest.raises(OpenAIError) as info:
        parse_request(cls, body).to_sampling_params()
    assert info.value.status_code == 400
    return info.value


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


def test_error_body_shape():
    assert error_body(400, "bad", "temperature") == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "temperature",
                  "code": 400}}
    assert error_body(404, "no such model")["error"]["type"] == "NotFoundError"
    assert error_body(413, "too big")["error"]["type"] == "RequestEntityTooLarge"
    assert error_body(500, "boom")["error"] == {
        "message": "boom", "type": "InternalServerError", "param": None, "code": 500}


def test_openai_error_carries_its_fields():
    e = OpenAIError(404, "The model `x` does not exist", param="model")
    assert (e.status_code, e.message, e.type, e.param) == (
        404, "The model `x` does not exist", "NotFoundError", "model")
    assert e.body() == error_body(404, "The model `x` does not exist", "model")
    assert str(e) == "The model `x` does not exist"


@pytest.mark.parametrize("cls, body, param, message", [
    (CompletionRequest, {"prompt": "x", "temperature": 3},
     "temperature", "temperature: Input should be less than or equal to 2"),
    (CompletionRequest, {"prompt": "x", "temperature": "hot"},
     "temperature", "temperature: Input should be a valid number"),
    (CompletionRequest, {}, "prompt", "prompt: Field required"),
    (CompletionRequest, {"prompt": "x", "n": 0}, "n", "n: Input should be greater than or equal to 1"),
    (ChatCompletionRequest, {"messages": [{"role": "bot", "content": "x"}]},
     "messages.0.role", "messages.0.role: Input should be 'system', 'user', 'assistant'"),
    (ChatCompletionRequest, {"messages": USER, "logit_bias": {"7": 101}},
     "logit_bias.7", "logit_bias.7: Input should be less than or equal to 100"),
])
def test_validation_messages_name_the_field(cls, body, param, message):
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    err = validation_error_to_openai(info.value)
    assert err.status_code == 400 and err.type == "BadRequestError"
    assert err.param == param
    assert err.message.startswith(message), err.message
    assert "Value error" not in err.message


def test_several_bad_fields_are_all_named():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "top_p": 0, "min_p": 2})
    message = validation_error_to_openai(info.value).message
    assert "top_p: Input should be greater than 0" in message
    assert "min_p: Input should be less than or equal to 1" in message


def test_parse_request_raises_openai_error():
    with pytest.raises(OpenAIError) as info:
        parse_request(CompletionRequest, {"prompt": []})
    assert info.value.param == "prompt"
    assert parse_request(CompletionRequest, {"prompt": "x"}).prompt == "x"


# ---------------------------------------------------------------------------------------
# Completion request validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt, needle", [
    ([], "prompt is an empty list"),
    ([[1], []], "prompt 1 is an empty list of token ids"),
    ([1, "a"], "not a mix"),
    ([1, True], "not a mix"),
    ([-1, 2], "prompt token ids must be >= 0"),
    (5, "prompt must be a string, a list of strings"),
    ({"text": "x"}, "prompt must be a string, a list of strings"),
])
def test_bad_prompts_are_refused(prompt, needle):
    err = refusal(CompletionRequest, {"prompt": prompt})
    assert needle in err.message and err.param == "prompt"


@pytest.mark.parametrize("body, param, needle", [
    ({"suffix": "!"}, "suffix", "suffix is not supported"),
    ({"best_of": 3}, "best_of", "best_of (3) different from n (1) is not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options can only be set when stream is true"),
    ({"stream": False, "stream_options": {}}, "stream_options", "only be set when stream"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "logit_bias key 'abc' is not a token id"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias", "is negative"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias.5", "greater than or equal to -100"),
    ({"stop": 5}, "stop", "stop must be a string or a list of strings"),
    ({"stop": ["a", 1]}, "stop", "stop must be a string or a list of strings"),
    ({"stop": [""]}, "stop", "stop must be non-empty strings"),
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"min_p": -0.5}, "min_p", "greater than or equal to 0"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "min_tokens (20) must be <= max_tokens (10)"),
    ({"seed": 2**64}, "seed", "less than or equal to"),
    ({"seed": "abc"}, "seed", "valid integer"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids.1", "greater than or equal to 0"),
    ({"logprobs": -2}, "logprobs", "or -1 for the whole vocabulary, got -2"),
    ({"logprobs": "2"}, "logprobs",
     "must be an integer >= 0, or -1 for the whole vocabulary, got '2'"),
    ({"prompt_logprobs": -3}, "prompt_logprobs", "or -1 for the whole vocabulary, got -3"),
    ({"prompt_logprobs": "all"}, "prompt_logprobs", "got 'all'"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "prompt_logprobs is not available when stream is true"),
    ({"logprob_token_ids": [1]}, "logprob_token_ids", "not supported over HTTP"),
    ({"use_beam_search": True}, "use_beam_search", "beam search is not supported"),
    ({"guided_json": {"type": "strin"}}, "guided_json", "guided_json: invalid JSON schema"),
    ({"max_tokens": "lots"}, "max_tokens", "valid integer"),
])
def test_completion_refusals(body, param, needle):
    err = refusal(CompletionRequest, {"prompt": "x", **body})
    assert needle in err.message, err.message
    assert err.param == param


def test_accepted_completion_oddities():
    # unknown fields are ignored, known ones at their harmless values pass
    req = completion(foo=1, use_beam_search=False, guided_json=None, best_of=1, suffix="",
                     stream=True, stream_options={"include_usage": True})
    assert req.model_extra == {"foo": 1, "use_beam_search": False, "guided_json": None}
    assert req.stream_options is not None and req.stream_options.include_usage
    assert completion(best_of=2, n=2).n == 2
    assert completion(logprobs=20).to_sampling_params().logprobs == 20
    assert completion(logprobs=-1, prompt_logprobs=0).to_sampling_params().prompt_logprobs == 0


# ---------------------------------------------------------------------------------------
# Chat request validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, needle", [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"content": "x"}]}, "messages.0.role", "Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "content part type 'image_url' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages.0.content", "content part type 'input_audio' is not supported"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages.0.content", "must be an object with a string 'type'"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content", "needs a string 'text'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "content must be a string, null or a list"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
     "chat_template_kwargs key 'tokenize' is reserved"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "key 'messages'"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "key 'tools'"),
    ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs",
     "key 'chat_template'"),
    ({"chat_template": "{{ messages }}"}, "chat_template",
     "per-request chat_template is not supported"),
    ({"documents": [{"text": "d"}]}, "documents", "documents is not supported"),
    ({"continue_final_message": True}, "continue_final_message",
     "continue_final_message and add_generation_prompt cannot both be true"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
     "needs a 'json_schema' object with a 'name'"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format must be"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice", "tool_choice naming a function needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice", "names function 'get_weather', which is not in tools ('f')"),
    ({"tool_choice": "always"}, "tool_choice", "tool_choice must be"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs set to true"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs", "or -1 for the whole vocabulary"),
    ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "stream is true"),
    ({"prompt_logprobs": -7}, "prompt_logprobs", "got -7"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"logit_bias": {"x1": 1}}, "logit_bias", "is not a token id"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
])
def test_chat_refusals(body, param, needle):
    err = refusal(ChatCompletionRequest, {"messages": USER, **body})
    assert needle in err.message, err.message
    assert err.param == param


def test_chat_accepts_text_parts_tools_and_template_kwargs():
    req = chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ], tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice="auto", response_format={"type": "text"},
        chat_template_kwargs={"enable_thinking": False},
        add_generation_prompt=False, continue_final_message=True)
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "developer"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert req.template_tools() == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert chat(tool_choice="none").tool_choice == "none"
    assert chat().add_generation_prompt is True and chat().add_special_tokens is False


# ---------------------------------------------------------------------------------------
# The SamplingParams mapping
# ---------------------------------------------------------------------------------------


def test_completion_sampling_params_field_by_field():
    req = completion(n=2, best_of=2, presence_penalty=0.5, frequency_penalty=-0.5,
                     repetition_penalty=1.2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                     seed=7, stop=["\n", "END"], stop_token_ids=[2, 3], ignore_eos=True,
                     max_tokens=33, min_tokens=4, skip_special_tokens=False,
                     spaces_between_special_tokens=False, include_stop_str_in_output=True,
                     logit_bias={"50": 5.5, "7": -100})
    p = req.to_sampling_params()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        2, 0.5, -0.5, 1.2)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 40, 0.05, 7)
    assert p.stop_strings == ["\n", "END"] and p.stop_token_ids == [2, 3]
    assert (p.ignore_eos, p.max_tokens, p.min_tokens) == (True, 33, 4)
    assert p.skip_special_tokens is False and p.spaces_between_special_tokens is False
    assert p.include_stop_str_in_output is True
    assert p.logit_bias == {50: 5.5, 7: -100.0}
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.output_kind == RequestOutputKind.FINAL_ONLY


def test_defaults_map_to_vllm_defaults():
    p = completion().to_sampling_params()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop_strings == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.seed is None and p.ignore_eos is False and p.min_tokens == 0
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.include_stop_str_in_output


def test_single_stop_string_and_disabled_top_k():
    p = completion(stop="###", top_k=-1, temperature=0).to_sampling_params()
    assert p.stop_strings == ["###"] and p.top_k == 0 and p.sampling_type_greedy


def test_output_kind_follows_stream_unless_given():
    assert completion(stream=True).to_sampling_params().output_kind == RequestOutputKind.DELTA
    assert chat(stream=True).to_sampling_params().output_kind == RequestOutputKind.DELTA
    assert chat().to_sampling_params().output_kind == RequestOutputKind.FINAL_ONLY
    kind = RequestOutputKind.CUMULATIVE
    assert completion().to_sampling_params(output_kind=kind).output_kind == kind


def test_generation_config_defaults_fill_only_what_the_request_leaves_null():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.1,
                "repetition_penalty": 1.1, "max_tokens": 5}
    p = chat(temperature=0.2).to_sampling_params(defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        0.2, 0.95, 20, 0.1, 1.1)
    assert p.max_tokens is None  # not a defaultable field


@pytest.mark.parametrize("body, expected", [
    ({}, 16),  # absent: the OpenAI default
    ({"max_tokens": 40}, 40),
    ({"max_tokens": None}, None),  # explicit null: unset
    ({"max_tokens": 0}, None),
    ({"max_tokens": -1}, None),  # Hermes' "no limit"
])
def test_completion_max_tokens_rule(body, expected):
    req = completion(**body)
    assert req.requested_max_tokens() == expected
    assert req.to_sampling_params().max_tokens == expected
    assert req.to_sampling_params(default_max_tokens=99).max_tokens == (expected or 99)


@pytest.mark.parametrize("body, expected", [
    ({}, None),
    ({"max_tokens": 40}, 40),
    ({"max_completion_tokens": 12}, 12),
    ({"max_tokens": 40, "max_completion_tokens": 12}, 12),  # max_completion_tokens wins
    ({"max_tokens": 12, "max_completion_tokens": 40}, 40),
    ({"max_tokens": -1}, None),
    ({"max_completion_tokens": 0}, None),
    ({"max_tokens": 30, "max_completion_tokens": -1}, 30),  # non-positive counts as absent
    ({"max_tokens": -1, "max_completion_tokens": -1}, None),
])
def test_chat_max_tokens_rule(body, expected):
    req = chat(**body)
    assert req.requested_max_tokens() == expected
    assert req.to_sampling_params().max_tokens == expected
    assert req.to_sampling_params(default_max_tokens=77).max_tokens == (expected or 77)


def test_request_only_fields_stay_on_the_request():
    req = completion(priority=-3, add_special_tokens=False, echo=True)
    assert (req.priority, req.add_special_tokens, req.echo) == (-3, False, True)
    assert completion().add_special_tokens is True and completion().priority == 0


# ---------------------------------------------------------------------------------------
# Tokenize / detokenize
# ---------------------------------------------------------------------------------------


def test_tokenize_request_is_picked_by_its_fields():
    req = parse_tokenize_request({"prompt": "hi"})
    assert isinstance(req, TokenizeCompletionRequest)
    assert req.add_special_tokens is True and req.return_token_strs is False
    chat_req = parse_tokenize_request({"messages": USER, "return_token_strs": True})
    assert isinstance(chat_req, TokenizeChatRequest)
    assert chat_req.add_generation_prompt and not chat_req.continue_final_message
    assert chat_req.add_special_tokens is False and chat_req.return_token_strs is True
    assert chat_req.template_messages() == USER
    for body in ({}, {"prompt": "x", "messages": USER}, [1, 2]):
        with pytest.raises(OpenAIError):
            parse_tokenize_request(body)
    with pytest.raises(OpenAIError, match="key 'tokenize' is reserved"):
        parse_tokenize_request({"messages": USER, "chat_template_kwargs": {"tokenize": 1}})
    with pytest.raises(OpenAIError, match="cannot both be true"):
        parse_tokenize_request({"messages": USER, "continue_final_message": True})


def test_detokenize_request():
    assert DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens == [1, 2]
    with pytest.raises(OpenAIError, match="tokens.0: Input should be greater than or equal"):
        parse_request(DetokenizeRequest, {"tokens": [-1]})
    with pytest.raises(OpenAIError, match="tokens: Field required"):
        parse_request(DetokenizeRequest, {})


# ---------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------


def test_random_ids_are_prefixed_and_unique():
    a, b = random_id("cmpl"), random_id("cmpl")
    assert a.startswith("cmpl-") and a != b
    assert ChatCompletionResponse(model="m", choices=[], usage=UsageInfo()).id.startswith(
        "chatcmpl-")


def _completion_response() -> dict[str, Any]:
    usage = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5,
                      prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=1))
    return CompletionResponse(model="m", choices=[
        CompletionResponseChoice(index=0, text="hi", finish_reason="length")],
        usage=usage).model_dump(mode="json")


def _chat_response() -> dict[str, Any]:
    msg = ChatMessage(content="hello", tool_calls=[ToolCall(
        function={"name": "f", "arguments": "{}"})])
    return ChatCompletionResponse(model="m", choices=[
        ChatCompletionResponseChoice(index=0, message=msg, finish_reason="tool_calls")],
        usage=UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    ).model_dump(mode="json")


def _chat_chunks() -> list[dict[str, Any]]:
    first = ChatCompletionStreamResponse(model="m", choices=[ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(role="assistant", content=""))])
    last = ChatCompletionStreamResponse(model="m", choices=[ChatCompletionResponseStreamChoice(
        index=0, delta=DeltaMessage(content="x"), finish_reason="stop")])
    usage = ChatCompletionStreamResponse(model="m", choices=[], usage=UsageInfo(
        prompt_tokens=1, completion_tokens=1, total_tokens=2))
    return [json.loads(c.model_dump_json()) for c in (first, last, usage)]


def _completion_chunks() -> list[dict[str, Any]]:
    chunk = CompletionStreamResponse(model="m", choices=[
        CompletionResponseStreamChoice(index=0, text="x")])
    usage = CompletionStreamResponse(model="m", choices=[], usage=UsageInfo())
    return [json.loads(c.model_dump_json()) for c in (chunk, usage)]


def _models() -> dict[str, Any]:
    return ModelList(data=[ModelCard(id="m", root="/models/m", max_model_len=4096)]
                     ).model_dump(mode="json")


def test_response_json_shapes():
    body = _completion_response()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "hi", "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    chat_body = _chat_response()
    assert chat_body["object"] == "chat.completion"
    choice = chat_body["choices"][0]
    assert choice["logprobs"] is None and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["role"] == "assistant" and choice["message"]["refusal"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    first, last, usage = _chat_chunks()
    assert first["object"] == "chat.completion.chunk" and "usage" not in first
    assert first["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None,
                                   "stop_reason": None}
    assert last["choices"][0]["delta"] == {"content": "x"}
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 2
    chunk, cusage = _completion_chunks()
    assert "usage" not in chunk and cusage["usage"]["prompt_tokens"] == 0
    models = _models()
    assert models["object"] == "list"
    assert models["data"][0]["object"] == "model" and models["data"][0]["owned_by"] == "vllmpy"
    assert models["data"][0]["max_model_len"] == 4096
    tok = TokenizeResponse(count=2, max_model_len=8, tokens=[1, 2]).model_dump(mode="json")
    assert tok == {"count": 2, "max_model_len": 8, "tokens": [1, 2], "token_strs": None}


# ---------------------------------------------------------------------------------------
# Responses against the OpenAI schema (when the spec is checked out beside the repository)
# ---------------------------------------------------------------------------------------

_SPEC = Path(__file__).resolve().parents[3].parent / "shared" / "specs" / "openai-openapi.json"
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
               "object": dict, "array": list}


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    if not _SPEC.exists():
        pytest.skip(f"the OpenAI spec is not at {_SPEC}")
    return json.loads(_SPEC.read_text())["components"]["schemas"]


def conform(value: Any, schema: dict[str, Any], schemas: dict[str, Any], path: str) -> None:
    """Check required keys, JSON types, enums and nullability, recursively."""
    if "$ref" in schema:
        conform(value, schemas[schema["$ref"].rsplit("/", 1)[1]] | {
            k: v for k, v in schema.items() if k != "$ref"}, schemas, path)
        return
    if value is None:
        nullable = schema.get("nullable") or any(
            s.get("type") == "null" for s in schema.get("anyOf", []) + schema.get("oneOf", []))
        assert nullable, f"{path} is null but the schema does not allow null"
        return
    options = [s for s in schema.get("anyOf", []) + schema.get("oneOf", [])
               if s.get("type") != "null"]
    if options:
        errors = []
        for option in options:
            try:
                conform(value, option, schemas, path)
                return
            except AssertionError as e:
                errors.append(str(e))
        raise AssertionError(f"{path} matches none of the schema's options: {errors}")
    kind = schema.get("type")
    if kind:
        assert isinstance(value, _JSON_TYPES[kind]) and not (
            kind in ("integer", "number") and isinstance(value, bool)), (
            f"{path} is {value!r}, not a JSON {kind}")
    if "enum" in schema:
        assert value in schema["enum"], f"{path} is {value!r}, not one of {schema['enum']}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{path} lacks the required key {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                conform(value[key], sub, schemas, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            conform(item, schema["items"], schemas, f"{path}[{i}]")


def test_responses_conform_to_the_openai_schema(schemas):
    conform(_completion_response(), schemas["CreateCompletionResponse"], schemas, "completion")
    conform(_chat_response(), schemas["CreateChatCompletionResponse"], schemas, "chat")
    for i, chunk in enumerate(_chat_chunks()):
        conform(chunk, schemas["CreateChatCompletionStreamResponse"], schemas, f"chunk{i}")
    # The spec gives streamed completions the response's shape, but a chunk before the last
    # carries "finish_reason": null, as OpenAI and vLLM send it; check the rest of it.
    mid, usage_chunk = _completion_chunks()
    assert mid["choices"][0]["finish_reason"] is None
    mid["choices"][0]["finish_reason"] = "stop"
    for i, chunk in enumerate((mid, usage_chunk)):
        conform(chunk, schemas["CreateCompletionResponse"], schemas, f"cchunk{i}")
    conform(_models(), schemas["ListModelsResponse"], schemas, "models")
    # "code" is the HTTP status as an integer, as vLLM sends it, where the spec has a string.
    conform(error_body(400, "bad", "n")["error"] | {"code": None},
            schemas["Error"], schemas, "error")


def test_the_schema_checker_catches_a_missing_key(schemas):
    body = _completion_response()
    del body["choices"][0]["logprobs"]
    with pytest.raises(AssertionError, match="lacks the required key 'logprobs'"):
        conform(body, schemas["CreateCompletionResponse"], schemas, "completion")
