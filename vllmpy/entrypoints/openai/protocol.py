"""Request and response bodies of the OpenAI-compatible server, with vLLM's field names.

Requests validate on construction: a bad or unsupported field raises pydantic's
``ValidationError`` (turned into a 400 by ``errors.validation_error_to_openai``; use
``parse_request`` to get an ``OpenAIError`` directly). Fields this server does not know
are ignored, as vLLM ignores them, except the vLLM and OpenAI fields it knows and cannot
honour yet, which are refused by name (``_REFUSED_EXTRAS``).

Responses serialize with ``model_dump(mode="json")`` (or ``model_dump_json()``) and no
exclusions: every field the OpenAI schema requires is present, a nullable one as ``null``
(``"logprobs": null`` in every choice). ``DeltaMessage`` alone leaves out what it does not
carry, since a stream delta holds only what changed.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from vllmpy.entrypoints.openai.errors import FieldError, bad_request, validation_error_to_openai
from vllmpy.entrypoints.openai.multimodal_limits import active_limits, content_refusal
from vllmpy.pooling.params import PoolingParams
from vllmpy.sampling_params import RequestOutputKind, SamplingParams
from vllmpy.structured_output import StructuredOutputsParams, validate_structured_outputs

_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1
# The most completions one request may ask for (OpenAI's bound on n).
MAX_N = 128
# The OpenAI default for /v1/completions when the request does not mention max_tokens.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# chat_template_kwargs keys the renderer supplies itself.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "chat_template", "tokenize")
# Sampling fields that a model's generation config may default (request values win), with
# the value used when neither sets them (vLLM's SamplingParams defaults).
DEFAULTABLE_SAMPLING_FIELDS: dict[str, float] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}

# Fields of vLLM's or OpenAI's request bodies that this server knows and does not honour
# yet: set to anything but null/false/empty, they are refused with the reason given.
_REFUSED_EXTRAS: dict[str, str] = {
    "use_beam_search": "beam search is not supported",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported; "
                                 "structured_outputs.disable_any_whitespace is",
    "bad_words": "bad_words is not supported yet",
    "allowed_token_ids": "allowed_token_ids is not supported yet",
    "logits_processors": "per-request logits_processors are not supported",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported yet",
    "prompt_embeds": "prompt_embeds is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported yet",
    "logprob_token_ids": "logprob_token_ids is not supported over HTTP yet; the library's "
                         "SamplingParams takes it",
    "kv_transfer_params": "kv_transfer_params is not supported",
    "vllm_xargs": "vllm_xargs is not supported",
    "mm_processor_kwargs": "mm_processor_kwargs is not supported: this server takes text only",
    "functions": "functions is not supported; use tools",
    "function_call": "function_call is not supported; use tool_choice",
    "prediction": "prediction (predicted outputs) is not supported",
    "audio": "audio output is not supported",
}


def ignored_fields(request: BaseModel) -> list[str]:
    """Top-level fields of a request that nothing reads (unknown to this server): they are
    served around and named in a warning, as vLLM does."""
    known = {*_REFUSED_EXTRAS, *_GUIDED_FIELDS, "structured_outputs"}
    return sorted(k for k in (request.model_extra or {}) if k not in known)


def random_id(prefix: str) -> str:
    """A unique response id such as ``cmpl-3f2a...`` or ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    """Base of every body: unknown fields are kept in ``model_extra`` and otherwise ignored."""

    model_config = ConfigDict(extra="allow")


M = TypeVar("M", bound=BaseModel)


def parse_request(cls: type[M], data: Any) -> M:
    """Validate a decoded JSON body as ``cls``; any failure is a 400 ``OpenAIError``."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_openai(exc) from None


# ---------------------------------------------------------------------------------------
# Requests: pieces
# ---------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True  # a last chunk carries the usage, choices empty
    continuous_usage_stats: bool | None = False  # every chunk carries the usage so far


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


def _check_content(value: Any) -> Any:
    """A message's content: a string, null, or a list of ``{"type": "text", "text": ...}``;
    a multimodal part is refused as ``multimodal_limits.content_refusal`` words it."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("content must be a string, null or a list of content parts")
    for i, part in enumerate(value):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError(f"content part {i} must be an object with a string 'type'")
    refusal = content_refusal(active_limits(), value)
    if refusal is not None:
        raise ValueError(refusal)
    for i, part in enumerate(value):
        if not isinstance(part.get("text"), str):
            raise ValueError(f"content part {i} of type 'text' needs a string 'text'")
    return value


class ChatMessageParam(OpenAIBaseModel):
    """One message of a chat request; unknown keys (such as ``reasoning_content``) travel
    to the chat template unchanged."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    _content = field_validator("content", mode="before")(_check_content)

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines, as vLLM's default
        "string" content format renders them."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: unset keys left out."""
        msg = self.model_dump(exclude_none=True)
        if self.content is not None:
            msg["content"] = self.text()
        return msg


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: FunctionName


def _check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    for key in value or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise FieldError("chat_template_kwargs",
                             f"chat_template_kwargs key {key!r} is reserved: the server "
                             f"supplies it from the request")
    return value


def _check_generation_prompt(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        raise FieldError("continue_final_message",
                         "continue_final_message and add_generation_prompt cannot both be "
                         "true: set add_generation_prompt to false to continue the last "
                         "message")


def _check_logprobs_count(value: Any, info: ValidationInfo) -> Any:
    """A logprobs count's shape: an integer >= 0, or -1 for the whole vocabulary. The
    engine bounds it (``--max-logprobs``)."""
    if value is None:
        return value
    name = info.field_name
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())
    if not whole or value < -1:
        raise FieldError(name or "logprobs",
                         f"{name} must be an integer >= 0, or -1 for the whole vocabulary, "
                         f"got {value!r}")
    return int(value)


def _check_response_format(value: Any) -> Any:
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}; the schema itself is checked with the request."""
    if value is None:
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object"):
        return value
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError("response_format json_schema needs a 'json_schema' object with "
                             "a 'name' and a 'schema'")
        if not isinstance(spec.get("schema"), (dict, bool)):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON "
                             "Schema object")
        return value
    if kind == "structural_tag":
        raise ValueError("response_format type 'structural_tag' is not supported yet")
    raise ValueError("response_format must be an object whose type is 'text', "
                     f"'json_object' or 'json_schema', got {value!r}")


# structured_outputs keys beyond the constraint: accepted at a harmless value only
# (disable_fallback at any: there is one backend, so never a fallback).
_STRUCTURED_OUTPUTS_HARMLESS: dict[str, Any] = {
    "disable_additional_properties": False, "whitespace_pattern": None,
    "structural_tag": None}
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def structured_outputs_from_request(response_format: dict[str, Any] | None,
                                    extras: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's output constraint, from the one field that sets it, checked (the
    schema, regex or grammar compiles): a 400 naming the field otherwise."""
    given: dict[str, dict[str, Any]] = {}
    if response_format is not None and response_format["type"] != "text":
        given["response_format"] = (
            {"json_object": True} if response_format["type"] == "json_object"
            else {"json": response_format["json_schema"]["schema"]})
    if extras.get("structured_outputs") is not None:
        given["structured_outputs"] = _structured_outputs_fields(extras["structured_outputs"])
    for name, kind in _GUIDED_FIELDS.items():
        if extras.get(name) is not None:
            given[name] = {kind: extras[name]}
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"only one of response_format, structured_outputs, "
                          f"{', '.join(_GUIDED_FIELDS)} may constrain the output; got "
                          f"{' and '.join(given)}", list(given)[1])
    (field, values), = given.items()
    try:
        params = StructuredOutputsParams(**values)
        validate_structured_outputs(params)
    except ValueError as e:
        raise bad_request(f"{field}: {e}", field) from None
    return params


def _structured_outputs_fields(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    fields: dict[str, Any] = {}
    for key, item in value.items():
        if key in StructuredOutputsParams.__dataclass_fields__:
            fields[key] = item
        elif key == "disable_fallback":
            continue
        elif key in _STRUCTURED_OUTPUTS_HARMLESS:
            if item not in (_STRUCTURED_OUTPUTS_HARMLESS[key], None):
                raise bad_request(f"structured_outputs.{key} is not supported",
                                  "structured_outputs")
        else:
            raise bad_request(f"structured_outputs has no field {key!r}; known: "
                              f"{', '.join(StructuredOutputsParams.__dataclass_fields__)}",
                              "structured_outputs")
    return fields


def _positive_or_none(value: int | None) -> int | None:
    """max_tokens <= 0 means unset (clients such as Hermes send -1 for "no limit")."""
    return value if value is not None and value > 0 else None


# ---------------------------------------------------------------------------------------
# Requests: the sampling fields both generation endpoints share
# ---------------------------------------------------------------------------------------


class _SamplingRequest(OpenAIBaseModel):
    """Fields and checks common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # null means 1, as OpenAI's spec has it
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=_LONG_MIN, le=_LONG_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    echo: bool | None = False
    # vLLM's extra sampling fields.
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: the whole vocabulary
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # -1: the whole vocabulary; refused when streaming
    # vLLM's scheduling extensions: lower priority first under --scheduling-policy
    # priority (non-zero is refused otherwise); a cache salt shares cached prefixes only
    # with requests carrying the same salt.
    priority: int = 0
    cache_salt: str | None = None
    # Structured output: response_format json_object / json_schema, or vLLM's
    # structured_outputs object or its older guided_json, guided_regex, guided_choice and
    # guided_grammar fields (read from the extras); at most one of them.
    response_format: dict[str, Any] | None = None

    _response_format = field_validator("response_format", mode="before")(
        _check_response_format)

    @field_validator("n", mode="before")
    @classmethod
    def _null_n(cls, value: Any) -> Any:
        return 1 if value is None else value

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise FieldError("cache_salt", "cache_salt must be a non-empty string if provided")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            try:
                token_id = int(key)
            except ValueError:
                raise FieldError("logit_bias", f"logit_bias key {key!r} is not a token id: "
                                 "keys must be integers such as \"50256\"") from None
            if token_id < 0:
                raise FieldError("logit_bias", f"logit_bias key {key!r} is negative: "
                                 "token ids are >= 0")
        return value

    _prompt_logprobs = field_validator("prompt_logprobs", mode="before")(_check_logprobs_count)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options",
                             "stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs",
                             "prompt_logprobs is not available when stream is true")
        for name, reason in _REFUSED_EXTRAS.items():
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, "", [], {}):
                raise FieldError(name, reason)

    def _default_output_kind(self) -> RequestOutputKind:
        return RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY

    def _build_sampling_params(self, max_tokens: int | None,
                               output_kind: RequestOutputKind | None,
                               defaults: dict[str, Any] | None, logprobs: int | None,
                               prompt_logprobs: int | None) -> SamplingParams:
        picked: dict[str, Any] = {}
        for name, fallback in DEFAULTABLE_SAMPLING_FIELDS.items():
            value = getattr(self, name)
            if value is None:
                value = (defaults or {}).get(name)
            picked[name] = fallback if value is None else value
        try:
            return SamplingParams(
                n=self.n,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=({int(k): v for k, v in self.logit_bias.items()}
                            if self.logit_bias else None),
                output_kind=self._default_output_kind() if output_kind is None else output_kind,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs_from_request(
                    self.response_format, self.model_extra or {}),
                **picked,
            )
        except ValueError as exc:
            message = str(exc)
            field = message.split(" ", 1)[0]
            raise bad_request(message, field if field in SamplingParams.__dataclass_fields__
                              else None) from None


# ---------------------------------------------------------------------------------------
# Requests: the endpoints
# ---------------------------------------------------------------------------------------


def _check_text_or_ids(value: Any, field: str) -> Any:
    """str | list[str] | list[int] | list[list[int]], nothing empty, ids >= 0; ``field``
    (prompt, input) names the body field in the refusal."""
    def is_id(t: Any) -> bool:
        return isinstance(t, int) and not isinstance(t, bool)

    forms = (f"{field} must be a string, a list of strings, a list of token ids or a list "
             f"of lists of token ids")
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(forms)
    if not value:
        raise ValueError(f"{field} is an empty list: give at least one {field}")
    if all(isinstance(p, str) for p in value):
        return value
    batches = [value] if all(is_id(t) for t in value) else value
    for i, ids in enumerate(batches):
        if not isinstance(ids, list) or not all(is_id(t) for t in ids):
            raise ValueError(f"{forms}, not a mix")
        if not ids:
            raise ValueError(f"{field} {i} is an empty list of token ids")
        if any(t < 0 for t in ids):
            raise ValueError(f"{field} token ids must be >= 0")
    return value


def _check_prompt(value: Any) -> Any:
    return _check_text_or_ids(value, "prompt")


def _as_batch(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A checked prompt or input as a batch: one entry per prompt, text or token ids."""
    if isinstance(value, str):
        return [value]
    if all(isinstance(t, int) for t in value):
        return [cast(list[int], value)]
    return list(cast(list[str | list[int]], value))


class CompletionRequest(_SamplingRequest):
    """Body of ``POST /v1/completions``.

    max_tokens rule (vLLM's and the OpenAI spec's, plus the documented non-positive rule):
    absent means 16, the OpenAI default that vLLM's completion request also uses; null or
    <= 0 means unset, which ``to_sampling_params`` turns into ``default_max_tokens`` and,
    when that is None, leaves to the engine: max_model_len - prompt length, capped by
    ``VT_SERVER_MAX_NEW_TOKENS`` when set.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    logprobs: int | None = None  # the top alternatives per token (-1: all), bounded by --max-logprobs
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    suffix: str | None = None
    add_special_tokens: bool = True

    _prompt = field_validator("prompt", mode="before")(_check_prompt)
    _logprobs = field_validator("logprobs", mode="before")(_check_logprobs_count)

    @model_validator(mode="after")
    def _check_request(self) -> CompletionRequest:
        self._check_common()
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", f"best_of ({self.best_of}) different from n "
                             f"({self.n}) is not supported: leave best_of unset")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: one entry per prompt, text or token ids."""
        return _as_batch(self.prompt)

    def requested_max_tokens(self) -> int | None:
        """The positive limit the request sets, or None when it leaves it unset."""
        return _positive_or_none(self.max_tokens)

    def to_sampling_params(self, default_max_tokens: int | None = None,
                           output_kind: RequestOutputKind | None = None, *,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's ``SamplingParams`` for every prompt of this request.

        ``default_max_tokens`` is used when the request leaves max_tokens unset (None keeps
        it unset for the engine to resolve). ``output_kind`` defaults to DELTA when
        streaming and FINAL_ONLY otherwise. ``defaults`` (for example from the model's
        generation config) fill ``DEFAULTABLE_SAMPLING_FIELDS`` the request leaves null.
        Raises a 400 ``OpenAIError`` naming the field for what the engine cannot honour.
        With echo, the prompt tokens get as many alternatives as the generated ones
        unless prompt_logprobs says otherwise (vLLM's rule).
        """
        max_tokens = self.requested_max_tokens() or default_max_tokens
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._build_sampling_params(max_tokens, output_kind, defaults, self.logprobs,
                                           prompt_logprobs)


class ChatCompletionRequest(_SamplingRequest):
    """Body of ``POST /v1/chat/completions``.

    max_tokens rule: a non-positive ``max_completion_tokens`` or ``max_tokens`` counts as
    absent; of what remains, ``max_completion_tokens`` wins over ``max_tokens``; if neither
    is left, max_tokens is unset: ``default_max_tokens``, or when that is None the engine's
    max_model_len - prompt length capped by ``VT_SERVER_MAX_NEW_TOKENS``.
    """

    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None  # alternatives per token with logprobs (-1: all), bounded by --max-logprobs
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    # None: "auto" with tools, "none" without
    tool_choice: (Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam
                  | None) = None
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)
    _top_logprobs = field_validator("top_logprobs", mode="before")(_check_logprobs_count)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (isinstance(value, dict) and value.get("type") == "function"
                and isinstance(function, dict) and isinstance(function.get("name"), str)):
            return value
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or "
                         f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                         f"got {value!r}")

    @model_validator(mode="after")
    def _check_request(self) -> ChatCompletionRequest:
        self._check_common()
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
        _check_generation_prompt(self.add_generation_prompt, self.continue_final_message)
        if self.chat_template is not None:
            raise FieldError("chat_template", "per-request chat_template is not supported: "
                             "the server renders with the model's template")
        if self.documents:
            raise FieldError("documents", "documents is not supported")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        """vLLM's rules: a tool_choice other than "none" needs tools, a named function
        must be one of them."""
        choice = self.tool_choice
        if choice in (None, "none"):
            return
        if not self.tools:
            what = repr(choice) if isinstance(choice, str) else "naming a function"
            raise FieldError("tool_choice", f"tool_choice {what} needs tools: set tools")
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            names = [t.function.name for t in self.tools]
            if choice.function.name not in names:
                raise FieldError("tool_choice", f"tool_choice names function "
                                 f"{choice.function.name!r}, which is not in tools "
                                 f"({', '.join(map(repr, names))})")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.model_dump(exclude_none=True)
                                                for t in self.tools]

    def requested_max_tokens(self) -> int | None:
        """The positive limit the request sets, or None when it leaves it unset."""
        return (_positive_or_none(self.max_completion_tokens)
                or _positive_or_none(self.max_tokens))

    def to_sampling_params(self, default_max_tokens: int | None = None,
                           output_kind: RequestOutputKind | None = None, *,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        """As ``CompletionRequest.to_sampling_params``, with the chat max_tokens rule."""
        max_tokens = self.requested_max_tokens() or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._build_sampling_params(max_tokens, output_kind, defaults, logprobs,
                                           self.prompt_logprobs)


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolParam] | None = None
    return_token_strs: bool | None = False

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)

    @model_validator(mode="after")
    def _check_request(self) -> TokenizeChatRequest:
        _check_generation_prompt(self.add_generation_prompt, self.continue_final_message)
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def parse_tokenize_request(data: Any) -> TokenizeRequest:
    """A /tokenize body is a chat request when it has ``messages``, a completion request
    when it has ``prompt``; both or neither is a 400."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    has_prompt, has_messages = "prompt" in data, "messages" in data
    if has_prompt == has_messages:
        raise bad_request("a tokenize request needs exactly one of prompt or messages",
                          "prompt")
    cls: type[TokenizeCompletionRequest] | type[TokenizeChatRequest] = (
        TokenizeChatRequest if has_messages else TokenizeCompletionRequest)
    return parse_request(cls, data)


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# ---------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIBaseModel):
    """Token counts; ``prompt_tokens_details`` is left out of the JSON unless set (the
    OpenAI schema has it as an object, never null)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


# vLLM's prompt_logprobs JSON: one entry per prompt token, null for the first, else
# {"<token id>": {"logprob", "rank", "decoded_token"}} with the prompt token first.
PromptLogprobsJSON = list[dict[str, dict[str, Any]] | None]


class CompletionLogProbs(OpenAIBaseModel):
    """A completion choice's logprobs: one entry per token in every list (with echo, the
    prompt tokens first, their first entry null); ``top_logprobs`` maps each alternative's
    text, and the token's own, to its logprob."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None  # the token text's UTF-8 bytes


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None
    refusal: list[ChatCompletionLogProbsContent] | None = None  # always null here


def _drop_null(data: dict[str, Any], key: str) -> dict[str, Any]:
    if data.get(key) is None:
        data.pop(key, None)
    return data


class CompletionResponseChoice(OpenAIBaseModel):
    """``prompt_logprobs`` is left out of the JSON unless the request asked for them."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    prompt_logprobs: PromptLogprobsJSON | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_null(handler(self), "prompt_logprobs")


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str  # the new text since the previous chunk
    logprobs: CompletionLogProbs | None = None  # of the new tokens
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _drop_null_usage(data: dict[str, Any]) -> dict[str, Any]:
    if data.get("usage") is None:
        data.pop("usage", None)
    return data


class CompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk of /v1/completions; ``usage`` is left out of the JSON unless set."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_null_usage(handler(self))


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None  # always null here; the OpenAI schema requires the key
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None  # "stop", "length", "tool_calls" or "abort"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    """``prompt_logprobs`` is left out of the JSON unless the request asked for them."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsJSON | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_null(handler(self), "prompt_logprobs")


class DeltaFunctionCall(OpenAIBaseModel):
    """A call's name (first delta only) and the next fragment of its arguments; what is
    not carried is left out of the JSON, as in OpenAI's streams."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIBaseModel):
    """One tool call's part of a stream delta: ``id`` and ``type`` on its first delta only
    (left out of the JSON otherwise)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(OpenAIBaseModel):
    """What a stream chunk adds to a choice's message; fields it does not carry are left
    out of its JSON (an empty string content is kept: it is the first chunk's)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None and v != []}


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None  # of the delta's tokens
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk of /v1/chat/completions; ``usage`` is left out of the JSON unless set
    (the last chunk under ``include_usage``, every chunk under ``continuous_usage_stats``)."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_null_usage(handler(self))


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vllmpy"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # What the engine serves (vLLM's task names): "generate", or a pooling model's, such as
    # ["embed", "score", "encode"]; ``task`` is the first, the model's main one.
    task: str | None = None
    tasks: list[str] | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ---------------------------------------------------------------------------------------
# Pooling: /v1/embeddings, /pooling, /classify, /score and /rerank (vLLM's shapes)
# ---------------------------------------------------------------------------------------


PoolingInput = str | list[str] | list[int] | list[list[int]]


class _PoolingRequest(OpenAIBaseModel):
    """Fields every pooling body shares (vLLM's ``PoolingBasicRequestMixin``). vLLM's
    tokenizing options are taken at the one value the engine does: a prompt past
    ``truncate_prompt_tokens`` loses its tail, with the tokenizer's special tokens kept."""

    model: str | None = None
    user: str | None = None  # accepted, unused
    # keep this many tokens of a longer prompt (-1: as many as the model takes) instead of
    # refusing it
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int = Field(0, ge=_LONG_MIN, le=_LONG_MAX)  # as for completions
    cache_salt: str | None = Field(None, min_length=1)
    truncation_side: Literal["right"] | None = None
    padding: Literal["do_not_pad"] | None = None
    mm_processor_kwargs: None = None  # text only

    @model_validator(mode="before")
    @classmethod
    def _refuse_messages(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("messages") is not None:
            raise FieldError("messages", "messages (chat-style input) is not supported by "
                             "the pooling endpoints: send input as text or token ids")
        return data

    def _params(self, **fields: Any) -> PoolingParams:
        """The engine's PoolingParams; what it refuses is a 400 naming the field."""
        try:
            return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                                 **fields)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise bad_request(str(exc), field if field in PoolingParams.__dataclass_fields__
                              else None) from None


class PoolingInputRequest(_PoolingRequest):
    """A pooling body over ``input``: a text, a list of texts, token ids or a list of
    token-id lists, one engine request each."""

    input: PoolingInput
    add_special_tokens: Literal[True] = True  # the tokenizer's special tokens are added

    _input = field_validator("input", mode="before")(
        lambda value: _check_text_or_ids(value, "input"))

    def inputs(self) -> list[str | list[int]]:
        return _as_batch(self.input)


class _EncodingFields(OpenAIBaseModel):
    """How vectors travel: JSON floats, or base64 of their little-endian float32 bytes
    (what the OpenAI SDK decodes)."""

    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "little"] = "native"


class EmbeddingRequest(PoolingInputRequest, _EncodingFields):
    """Body of ``POST /v1/embeddings``. ``dimensions`` keeps the first dimensions of a
    matryoshka model's vector; ``normalize`` (vLLM's older name) or ``use_activation``
    (its newer one, which wins) overrides the checkpoint's normalizing."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def to_pooling_params(self) -> PoolingParams:
        normalize = self.normalize if self.use_activation is None else self.use_activation
        return self._params(task="embed", dimensions=self.dimensions, normalize=normalize)


class PoolingRequest(EmbeddingRequest):
    """Body of vLLM's ``POST /pooling``: the model's raw output per input, by default
    every token's hidden state (task "encode"); "embed" and "classify" pool as those
    endpoints do."""

    task: Literal["encode", "embed", "classify"] | None = None

    def to_pooling_params(self) -> PoolingParams:
        task = self.task or "encode"
        if task == "embed":
            return super().to_pooling_params()
        if self.dimensions is not None:
            raise bad_request(f"dimensions applies to the embed task, not {task}", "dimensions")
        return self._params(task=task, use_activation=self.use_activation)


class ClassificationRequest(PoolingInputRequest):
    """Body of vLLM's ``POST /classify``: class probabilities per input (raw logits with
    ``use_activation`` false)."""

    use_activation: bool | None = None

    def to_pooling_params(self) -> PoolingParams:
        return self._params(task="classify", use_activation=self.use_activation)


class _ScoringRequest(_PoolingRequest):
    use_activation: bool | None = None  # a cross-encoder's sigmoid / softmax (default on)

    def to_pooling_params(self) -> PoolingParams:
        return self._params(task="score", use_activation=self.use_activation)


class ScoreRequest(_ScoringRequest):
    """Body of vLLM's ``POST /score``: one text against each of a list, or two lists of
    the same length pairwise (``vllmpy.engine.llm.score_pairs``)."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_ScoringRequest):
    """Body of ``POST /rerank`` (Jina's and Cohere's shape, vLLM's fields): the documents
    ranked by relevance to the query, the best ``top_n`` (0: all) returned, with their
    text unless ``return_documents`` is false (Cohere's field; vLLM always returns it)."""

    query: str
    documents: list[str]
    top_n: int = 0
    return_documents: bool = True


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of the little-endian float32 bytes


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[list[float]] | list[float] | str  # [tokens, hidden] for encode; str: base64


class PoolingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None  # the config's id2label of the most likely class
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    """One ranked document; ``document`` is left out of the JSON with return_documents
    false."""

    index: int  # in the request's documents
    document: RerankDocument | None = None
    relevance_score: float

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _drop_null(handler(self), "document")


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]
