"""Rendering a Jinja chat template the way Hugging Face transformers does.

The environment matches transformers' `apply_chat_template`: a sandbox, `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text
(`ensure_ascii=False`) and accepts `indent` / `separators` / `sort_keys`, and the globals
`raise_exception(msg)` and `strftime_now(fmt)`. One difference: reaching for an attribute
the sandbox forbids (`''.__class__`, a list's `append`) fails the render at once with a
`ChatTemplateError`, where Jinja's sandbox would hand back an undefined value that prints
as nothing.

Variables given to the template: `messages`, `add_generation_prompt`, `tools`, `bos_token`,
`eos_token`, and every key of `chat_template_kwargs`. A key that is not passed is not defined at
all, so `{% if enable_thinking is defined %}` tells "not passed" from "passed as false".
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# Appended to the final message when continuing it, to find where its content ends.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_RESERVED_KWARGS = frozenset({"messages", "add_generation_prompt", "tools"})


class ChatTemplateError(ValueError):
    """The chat template refused the conversation, failed to parse, or failed to render."""


class ChatTemplateSandboxError(ChatTemplateError):
    """The chat template reached for an attribute outside Jinja's sandbox."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with a forbidden attribute an error rather than an
    undefined value: a template that reaches outside the sandbox is refused, never
    rendered with a hole in it."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            f"object is unsafe")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a template once; later calls with the same text reuse the compiled one."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse (line {e.lineno}): "
                                f"{e.message}") from None


def _content_text(content: Any, where: str) -> Any:
    """String content stays; a list of `{"type": "text", "text": ...}` parts is joined by '\\n'."""
    if not isinstance(content, list):
        return content
    texts = []
    for n, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where} content part {n} has type {kind!r}; only 'text' parts "
                             f"are supported")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where} content part {n} has no string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_call_for_template(call: Any, where: str) -> Any:
    """An OpenAI tool call carries its arguments as JSON text; templates expect the object
    (they write ``arguments | tojson``), so the text is decoded, as vLLM does. Empty
    arguments are ``{}``."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), (dict, list)):
        return call
    text = function.get("arguments")
    try:
        arguments = json.loads(text) if text else {}
    except (TypeError, ValueError):
        raise ValueError(f"{where} tool call arguments are not JSON: {text!r}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Fresh copies of the messages with list content joined into one string and tool-call
    arguments decoded from JSON text."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {n} must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {n} has no string 'role'")
        copy = dict(message)
        if "content" in copy:
            copy["content"] = _content_text(copy["content"], f"message {n}")
        if isinstance(copy.get("tool_calls"), list):
            copy["tool_calls"] = [_tool_call_for_template(c, f"message {n}")
                                  for c in copy["tool_calls"]]
        out.append(copy)
    return out


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render `messages` with `template`.

    `continue_final_message=True` renders without a generation prompt and cuts the text right
    after the final message's content, so generation continues that message; it cannot be
    combined with `add_generation_prompt=True`.
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True cannot be combined with "
                         "add_generation_prompt=True")
    chat = normalize_messages(messages)
    extra = dict(chat_template_kwargs or {})
    for key in extra:
        if not isinstance(key, str) or key in _RESERVED_KWARGS:
            raise ValueError(f"chat_template_kwargs key {key!r} is not allowed; "
                             f"{sorted(_RESERVED_KWARGS)} are set by the request itself")
    if continue_final_message:
        final = chat[-1].get("content") if chat else None
        if not isinstance(final, str):
            raise ValueError("continue_final_message=True needs a final message with text "
                             "content to continue")
        chat[-1]["content"] = final + _CONTINUE_TAG

    variables = {"bos_token": bos_token, "eos_token": eos_token, **extra,
                 "messages": chat, "add_generation_prompt": add_generation_prompt,
                 "tools": tools}
    compiled = compile_chat_template(template)
    try:
        rendered = compiled.render(**variables)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateSandboxError(f"the chat template reached outside Jinja's sandbox: "
                                       f"{e}; a chat template may not touch Python "
                                       f"internals") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
            AttributeError, ArithmeticError) as e:
        raise ChatTemplateError(f"the chat template failed to render these messages: "
                                f"{type(e).__name__}: {e}") from None

    if continue_final_message:
        rendered = _cut_after_final_message(rendered)
    return rendered


def _cut_after_final_message(rendered: str) -> str:
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message=True but the chat template does not "
                                "write the final message's content")
    if rendered.startswith(_CONTINUE_TAG, at):
        return rendered[:at]
    # The template trimmed the message's trailing whitespace (and the tag's space with it).
    return rendered[:at].rstrip()


# A --chat-template value with none of these characters is a path, never template text
# (vLLM's rule).
_TEMPLATE_CHARS = "{}\n"
# The conversation a template given at start-up is first rendered with.
_PROBE_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "Hello!"}]


def load_chat_template_arg(value: str, flag: str = "--chat-template") -> str:
    """The template a ``--chat-template`` value stands for, checked as ``check_chat_template``
    checks it: an existing file is read; a value with none of '{', '}' or a newline that
    opens no file looks like a path and is refused (the file is missing); anything else is
    the template text itself."""
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ChatTemplateError(f"{flag} {value!r}: the file is not UTF-8 text") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the value
        if not any(c in value for c in _TEMPLATE_CHARS):
            raise ChatTemplateError(
                f"{flag} {value!r} looks like a file path (it has no '{{', '}}' or newline), "
                f"but the file is missing ({e}); pass an existing template file or the "
                f"template text itself") from None
        text = value
    check_chat_template(text, flag)
    return text


def check_chat_template(template: str, where: str) -> None:
    """Refuse, naming ``where``, a template that does not compile (with its line) or that
    reaches outside the sandbox when it renders a plain system + user conversation. A
    template that fails on that conversation otherwise (``raise_exception`` on a role it
    does not take, say) passes: each request's own conversation decides then."""
    try:
        compile_chat_template(template)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{where}: {e}") from None
    try:
        render_chat_template(template, _PROBE_MESSAGES, add_generation_prompt=True)
    except ChatTemplateSandboxError as e:
        raise ChatTemplateError(f"{where}: {e}") from None
    except ChatTemplateError:
        pass
