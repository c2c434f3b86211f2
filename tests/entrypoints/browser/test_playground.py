"""The playground at ``/`` in headless Chromium, against a real server.

What the page shows is checked against the server's own answer to the same request sent
by the OpenAI client (greedy, so both are the same tokens), not against the page's code.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

STREAM_TIMEOUT_MS = 120_000  # a 2-core CPU machine decodes a few tokens a second


def open_playground(page, server) -> None:
    page.goto(f"{server.url}/")
    page.wait_for_function(
        "document.getElementById('model-name').textContent.includes('context')")


def set_fields(page, **values: str) -> None:
    for field, value in values.items():
        page.fill(f"#{field.replace('_', '-')}", value)


def watch_content_lengths(page) -> None:
    """Record the first assistant message's text length at every DOM change."""
    page.evaluate("""() => {
        window.seenLengths = [];
        new MutationObserver(() => {
            const c = document.querySelector('.message.assistant .content');
            if (c) window.seenLengths.push(c.textContent.length);
        }).observe(document.getElementById('messages'),
                   {subtree: true, childList: true, characterData: true});
    }""")


def wait_reply_done(page) -> None:
    page.wait_for_selector(".message.assistant:not(.streaming)", timeout=STREAM_TIMEOUT_MS)


def abort_count(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort series in /metrics")


def model_id(server) -> str:
    return server.client().models.list().data[0].id


def test_chat_streams_the_servers_answer(page, ui_server, screenshots):
    open_playground(page, ui_server)
    set_fields(page, temperature="0", max_tokens="32")
    watch_content_lengths(page)
    question = "Name three fruits."
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")  # Enter sends
    wait_reply_done(page)

    shown = page.text_content(".message.assistant .content")
    stats = page.text_content(".message.assistant [data-testid=message-stats]")
    answer = ui_server.client().chat.completions.create(
        model=model_id(ui_server), messages=[{"role": "user", "content": question}],
        temperature=0, max_tokens=32)
    assert shown == answer.choices[0].message.content
    assert re.match(rf"{answer.usage.completion_tokens} tokens · prompt "
                    rf"{answer.usage.prompt_tokens} · [0-9.]+ tok/s · first token [0-9.]+ s · "
                    rf"{answer.choices[0].finish_reason}$", stats), stats
    # it streamed: the text grew over several updates before the end
    lengths = page.evaluate("window.seenLengths")
    assert len({n for n in lengths if 0 < n < len(shown)}) >= 3, lengths
    assert page.text_content(".message.user .content") == question
    assert page.input_value("#prompt") == ""
    assert page.console_errors == []
    page.screenshot(path=str(screenshots / "playground.png"))


def test_a_second_turn_sends_the_conversation_and_system_prompt(page, ui_server):
    open_playground(page, ui_server)
    set_fields(page, temperature="0", max_tokens="8", system_prompt="Answer in one word.")
    page.fill("#prompt", "What colour is the sky?")
    page.click("[data-testid=send]")
    wait_reply_done(page)
    first = page.text_content(".message.assistant .content")
    page.fill("#prompt", "And grass?")
    page.keyboard.press("Enter")  # focus came back to the message box
    page.wait_for_function("document.querySelectorAll('.message.assistant:not(.streaming)')"
                           ".length === 2", timeout=STREAM_TIMEOUT_MS)
    second = page.locator(".message.assistant .content").nth(1).text_content()
    answer = ui_server.client().chat.completions.create(
        model=model_id(ui_server), temperature=0, max_tokens=8, messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What colour is the sky?"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And grass?"}])
    assert second == answer.choices[0].message.content


def test_stop_aborts_mid_stream(page, ui_server):
    open_playground(page, ui_server)
    set_fields(page, temperature="0", max_tokens="1500")
    before = abort_count(ui_server)
    page.fill("#prompt", "Write a long story about a dragon who learns to fly. Make it at least "
                          "two thousand words long.")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        "(document.querySelector('.message.assistant .content') || {}).textContent"
        "?.length > 20", timeout=STREAM_TIMEOUT_MS)
    page.click("[data-testid=stop]")
    wait_reply_done(page)
    stats = page.text_content(".message.assistant [data-testid=message-stats]")
    assert stats.endswith("stopped"), stats
    assert stats.startswith("≈")  # no usage chunk came: the count is the page's own
    shown = page.text_content(".message.assistant .content")
    page.wait_for_timeout(1000)
    assert page.text_content(".message.assistant .content") == shown  # nothing more came
    assert page.is_enabled("[data-testid=send]") and page.is_hidden("[data-testid=stop]")
    # the server saw the client go and aborted the request
    for _ in range(100):
        if abort_count(ui_server) > before:
            break
        page.wait_for_timeout(100)
    assert abort_count(ui_server) == before + 1
    assert page.console_errors == []


def test_raw_completion_mode(page, ui_server):
    open_playground(page, ui_server)
    page.check("input[name=mode][value=completion]")
    assert page.is_hidden("#messages") and page.is_hidden("#system-prompt")
    set_fields(page, temperature="0", max_tokens="12")
    prompt = "The capital of France is"
    page.fill("#completion-text", prompt)
    page.press("#completion-text", "Control+Enter")
    page.wait_for_function("document.getElementById('completion-stats').textContent"
                           ".includes('length') || document.getElementById('completion-stats')"
                           ".textContent.includes('stop')", timeout=STREAM_TIMEOUT_MS)
    answer = ui_server.client().completions.create(
        model=model_id(ui_server), prompt=prompt, temperature=0, max_tokens=12)
    assert page.input_value("#completion-text") == prompt + answer.choices[0].text
    assert page.text_content("#completion-stats").startswith(
        f"{answer.usage.completion_tokens} tokens")


def test_json_schema_response_format(page, ui_server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    open_playground(page, ui_server)
    set_fields(page, temperature="0", max_tokens="40")
    page.select_option("#response-format", "json_schema")
    page.fill("#json-schema", json.dumps(schema))
    page.fill("#prompt", "Which city is the Eiffel Tower in? Answer in JSON.")
    page.press("#prompt", "Enter")
    wait_reply_done(page)
    shown = page.text_content(".message.assistant .content")
    jsonschema.validate(json.loads(shown), schema)


def test_tool_calls_are_shown_as_calls(page, ui_server):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                   "maxLength": 12}},
                       "required": ["city"]}}}]
    open_playground(page, ui_server)
    set_fields(page, temperature="0", max_tokens="60")
    page.click("details.field summary")
    page.fill("#tools", json.dumps(tools))
    page.select_option("#tool-choice", "required")
    page.fill("#prompt", "What is the weather in Paris?")
    page.press("#prompt", "Enter")
    wait_reply_done(page)
    card = page.locator("[data-testid=tool-call]")
    assert card.count() == 1
    assert card.locator(".tool-name").text_content() == "get_weather()"
    args = json.loads(card.locator(".tool-args").text_content())
    assert set(args) == {"city"} and isinstance(args["city"], str)
    assert page.console_errors == []


def test_reasoning_is_folded(page, ui_server):
    """The page's rendering of reasoning_content deltas: a canned stream in OpenAI's
    format stands in for a reasoning model (none is packaged small enough for CI)."""
    def chunk(delta=None, finish=None, usage=None):
        body = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [] if usage else [{"index": 0, "delta": delta or {},
                                              "finish_reason": finish}]}
        if usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    stream = "".join([
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "The user greets me. "}),
        chunk({"reasoning_content": "I greet back."}),
        chunk({"content": "Hello"}), chunk({"content": " there!"}),
        chunk(finish="stop"),
        chunk(usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}),
        "data: [DONE]\n\n"])
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=stream))
    open_playground(page, ui_server)
    page.fill("#prompt", "Hi")
    page.press("#prompt", "Enter")
    wait_reply_done(page)
    details = page.locator(".message.assistant details.reasoning")
    assert details.is_visible()
    assert details.evaluate("d => d.open") is False
    assert details.locator("summary").text_content() == "Reasoning (33 characters)"
    assert page.text_content(".message.assistant .content") == "Hello there!"
    details.locator("summary").click()
    assert details.locator(".reasoning-text").text_content() == (
        "The user greets me. I greet back.")
    assert page.text_content("[data-testid=message-stats]").startswith("9 tokens · prompt 5")


def test_bad_input_is_named_and_the_server_stays_up(page, ui_server):
    open_playground(page, ui_server)
    page.fill("#seed", "1.5")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    assert page.text_content("#error-banner") == 'Seed must be an integer, got "1.5"'
    assert page.locator(".message").count() == 0  # nothing was sent
    page.fill("#seed", "")
    page.select_option("#response-format", "json_schema")
    page.fill("#json-schema", "{not json")
    page.press("#prompt", "Enter")
    assert "The JSON schema is not valid JSON" in page.text_content("#error-banner")
    page.select_option("#response-format", "text")
    # a value only the server refuses: its error message is shown on the reply
    page.fill("#temperature", "-1")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".message.failed .message-error", timeout=STREAM_TIMEOUT_MS)
    assert "temperature" in page.text_content(".message-error")
    set_fields(page, temperature="0", max_tokens="4")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.querySelectorAll('.message.assistant:not(.streaming)')"
                           ".length === 2", timeout=STREAM_TIMEOUT_MS)
    assert "tokens" in page.locator("[data-testid=message-stats]").nth(1).text_content()


def test_api_key_is_asked_for_and_sent(page, keyed_server, api_key):
    page.goto(f"{keyed_server.url}/")
    page.wait_for_selector("#key-banner:not([hidden])")
    assert page.text_content("#model-name") == "API key needed"
    page.fill("#api-key", "wrong")
    page.press("#api-key", "Enter")
    page.wait_for_function("document.getElementById('error-banner').textContent"
                           ".includes('refused')")
    page.fill("#api-key", api_key)
    page.click("#key-form button")
    page.wait_for_function(
        "document.getElementById('model-name').textContent.includes('context')")
    assert page.is_hidden("#key-banner")
    set_fields(page, max_tokens="4")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    wait_reply_done(page)
    assert page.locator(".message.failed").count() == 0
    # kept in the tab only, never in the long-lived storage
    assert page.evaluate("sessionStorage.getItem('vllmpy.apiKey')") == api_key
    assert api_key not in json.dumps(page.evaluate("Object.assign({}, localStorage)"))


def test_accessibility_basics(page, ui_server):
    open_playground(page, ui_server)
    unlabeled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea')]
        .filter(e => e.type !== 'hidden' && e.labels.length === 0
                && !e.getAttribute('aria-label'))
        .map(e => e.id || e.outerHTML)""")
    assert unlabeled == []
    nameless = page.evaluate("""() => [...document.querySelectorAll('button')]
        .filter(b => !b.textContent.trim() && !b.getAttribute('aria-label'))
        .map(b => b.outerHTML)""")
    assert nameless == []
    assert page.evaluate("document.documentElement.lang") == "en"
    assert page.evaluate("document.activeElement.id") == "prompt"  # ready to type
    assert page.locator("main").count() == 1 and page.locator("header").count() == 1
    # Shift+Enter adds a line instead of sending
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two"
    assert page.locator(".message").count() == 0
