"""Chat templates render in Jinja's sandbox: a template reaching outside it is refused with
a clear error, per render (a request's 400) and at start-up for --chat-template."""

from __future__ import annotations

import pytest

from vllmpy.tokenizer.chat_template import (
    ChatTemplateError,
    check_chat_template,
    load_chat_template_arg,
    render_chat_template,
)

USER = [{"role": "user", "content": "Hi"}]
OUTSIDE = "reached outside Jinja's sandbox"

ESCAPES = {
    "str_mro": ("{{ ''.__class__.__mro__ }}", "'__class__' of 'str' object is unsafe"),
    "str_class": ("{{ ''.__class__ }}", "'__class__' of 'str' object is unsafe"),
    "cycler_globals": ("{{ cycler.__init__.__globals__ }}", "'__init__' of 'type' object"),
    "joiner_globals": ("{{ joiner.__init__.__globals__.os }}", "'__init__' of 'type' object"),
    "self_globals": ("{{ self.__init__.__globals__ }}",
                     "'__init__' of 'TemplateReference' object"),
    "message_dict": ("{% for m in messages %}{{ m.__class__ }}{% endfor %}",
                     "'__class__' of 'dict' object is unsafe"),
    "mutate_messages": ("{{ messages.pop() }}", "'pop' of 'list' object is unsafe"),
    "format_string": ("{{ '{0.__class__}'.format(1) }}", "'__class__' of 'int' object"),
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_a_render_reaching_outside_the_sandbox_is_refused(name):
    template, detail = ESCAPES[name]
    with pytest.raises(ChatTemplateError) as e:
        render_chat_template(template, USER)
    assert OUTSIDE in str(e.value) and detail in str(e.value), str(e.value)


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_at_start_up_such_a_chat_template_is_refused(name, tmp_path):
    template, detail = ESCAPES[name]
    with pytest.raises(ChatTemplateError) as e:
        check_chat_template(template, "--chat-template")
    assert str(e.value).startswith(f"--chat-template: the chat template {OUTSIDE}: ")
    assert detail in str(e.value)
    path = tmp_path / "bad.jinja"
    path.write_text(template)
    with pytest.raises(ChatTemplateError, match=OUTSIDE):
        load_chat_template_arg(str(path))


def test_a_template_escaping_only_on_some_conversations_is_refused_per_render():
    # the start-up probe (system + user) does not take the branch; a tool message does
    template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ m.content.__class__ }}"
                "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}")
    check_chat_template(template, "--chat-template")
    assert render_chat_template(template, USER) == "user: Hi\n"
    with pytest.raises(ChatTemplateError, match=f"{OUTSIDE}: access to attribute "
                                                 f"'__class__' of 'str' object is unsafe"):
        render_chat_template(template, [*USER, {"role": "tool", "content": "42"}])


def test_what_the_sandbox_allows_still_renders():
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{{ m['role'] | upper }}={{ m.content | length }};{% endfor %}{{ ns.n }}"
                "{{ messages[0].get('content') }}{{ 'a,b'.split(',') | join('+') }}")
    assert render_chat_template(template, USER) == "USER=2;1Hia+b"
