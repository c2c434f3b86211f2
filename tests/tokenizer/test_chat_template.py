"""Chat templates: the real checkpoints' templates against transformers, and the environment."""

from __future__ import annotations

import pytest

from vllmpy.tokenizer import ChatTemplateError, render_chat_template

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hi there!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 12345 * 3.14159?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour ! 🎉"},
        {"role": "user", "content": "Écris du code:\n\tdef f(x):\n\t    return x  # 中文"},
    ],
    "assistant_last": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1, 2,"},
    ],
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_and_ids_match_transformers(pair, name, add_generation_prompt):
    ours, ref = pair
    messages = CONVERSATIONS[name]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = ref.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    assert text == expected
    assert ours.encode(text, add_special_tokens=False) == ref.encode(expected,
                                                                     add_special_tokens=False)


def test_tools_match_transformers(qwen):
    ours, ref = qwen
    messages = CONVERSATIONS["system_user"]
    text = ours.apply_chat_template(messages, tools=[WEATHER_TOOL])
    expected = ref.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False,
                                       add_generation_prompt=True)
    assert text == expected
    assert "°C" in text  # tojson keeps non-ASCII text


def test_continue_final_message_matches_transformers(pair):
    ours, ref = pair
    messages = CONVERSATIONS["assistant_last"]
    text = ours.apply_chat_template(messages, add_generation_prompt=False,
                                    continue_final_message=True)
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True)
    assert text == expected
    assert text.endswith("1, 2,")
    with pytest.raises(ValueError, match="continue_final_message"):
        ours.apply_chat_template(messages, add_generation_prompt=True,
                                 continue_final_message=True)


def test_text_parts_are_joined(smollm):
    ours, _ = smollm
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"},
                                          {"type": "text", "text": "second"}]}]
    plain = [{"role": "user", "content": "first\nsecond"}]
    assert ours.apply_chat_template(parts) == ours.apply_chat_template(plain)
    assert parts[0]["content"][0] == {"type": "text", "text": "first"}  # caller's list untouched
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="'image_url'"):
        ours.apply_chat_template(image)


THINKING = ("{% if enable_thinking is defined %}defined:{{ enable_thinking }}"
            "{% else %}undefined{% endif %}|{{ messages | length }}|{{ add_generation_prompt }}")


def test_chat_template_kwargs_defined_only_when_passed():
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat_template(THINKING, msgs) == "undefined|1|True"
    assert render_chat_template(THINKING, msgs, chat_template_kwargs={}) == "undefined|1|True"
    got = render_chat_template(THINKING, msgs, chat_template_kwargs={"enable_thinking": False})
    assert got == "defined:False|1|True"
    with pytest.raises(ValueError, match="'messages'"):
        render_chat_template(THINKING, msgs, chat_template_kwargs={"messages": []})


def test_environment_helpers():
    msgs = [{"role": "user", "content": "héllo <b>"}]
    template = ("{{ messages[0] | tojson }}|{{ {'a': [1, 2]} | tojson(indent=2) }}|"
                "{{ {'b': 1} | tojson(separators=(',', ':')) }}|{{ bos_token }}{{ eos_token }}")
    got = render_chat_template(template, msgs, bos_token="<s>", eos_token="</s>")
    assert got == ('{"role": "user", "content": "héllo <b>"}|{\n  "a": [\n    1,\n    2\n  ]\n}|'
                   '{"b":1}|<s></s>')
    year = render_chat_template("{{ strftime_now('%Y') }}", msgs)
    assert year.isdigit() and len(year) == 4
    # trim_blocks / lstrip_blocks and loop controls.
    loop = ("{% for m in [1, 2, 3] %}\n    {% if m == 2 %}{% continue %}{% endif %}\n"
            "{{ m }}\n{% endfor %}")
    assert render_chat_template(loop, msgs) == "1\n3\n"


def test_template_errors_are_value_errors():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="only user roles"):
        render_chat_template("{{ raise_exception('only user roles') }}", msgs)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat_template("{% if %}", msgs)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render_chat_template("{{ messages[0]['content'] + 1 }}", msgs)
    with pytest.raises(ValueError, match="message 0 has no string 'role'"):
        render_chat_template("x", [{"content": "x"}])
    # The sandbox refuses attribute escapes.
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                             msgs)


def test_no_template_is_refused(smollm):
    ours, _ = smollm
    import copy

    bare = copy.copy(ours)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
