"""The dashboard at ``/dashboard`` in headless Chromium, against real servers.

Requests go through the OpenAI client; the page must show them by itself (it polls
``/dashboard/data`` every second), without a reload. The numbers it shows are read from
the tiles' ``data-value`` attributes and compared with the client's usage.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow

WAIT_MS = 60_000  # the history samples each second; a 2-core CPU decodes slowly
TILES = ["running", "waiting", "kv", "prefix-hit", "gen-tps", "prompt-tps", "ttft-p50",
         "ttft-p90", "ttft-p99", "itl-p50", "itl-p90", "itl-p99", "finished", "e2e-p50",
         "e2e-p99", "preemptions"]


def open_dashboard(page, server) -> None:
    page.goto(f"{server.url}/dashboard")
    page.wait_for_selector("[data-testid=live][data-state=live]", timeout=WAIT_MS)


def tile_number(page, name: str, attr: str = "value") -> float:
    raw = page.get_attribute(f"[data-testid=tile-{name}]", f"data-{attr}")
    return float(raw) if raw else 0.0


def test_tiles_follow_served_requests_in_place(page, ui_server, screenshots):
    open_dashboard(page, ui_server)
    for name in TILES:
        assert page.is_visible(f"[data-testid=tile-{name}]"), name
    model = ui_server.client().models.list().data[0].id
    page.wait_for_function("id => document.getElementById('model-name').textContent === id",
                           arg=model)
    assert page.is_hidden("[data-testid=banner]")
    assert page.is_hidden("[data-testid=tile-spec-accept]")  # no speculative decoding here
    assert page.get_attribute("[data-testid=playground-link]", "href") == "/"
    page.evaluate("window.sameDocument = true")  # gone if the page reloads

    tokens_before = tile_number(page, "gen-tps", "tokens")
    finished_before = tile_number(page, "finished")
    generated = 0
    for prompt in ("The capital of France is", "One, two, three,"):
        out = ui_server.client().completions.create(model=model, prompt=prompt, max_tokens=12,
                                                    temperature=0)
        generated += out.usage.completion_tokens
    page.wait_for_function(
        """([tokens, finished]) => {
            const gen = document.querySelector('[data-testid=tile-gen-tps]');
            const done = document.querySelector('[data-testid=tile-finished]');
            return Number(gen.dataset.tokens) >= tokens && Number(done.dataset.value) >= finished;
        }""", arg=[tokens_before + generated, finished_before + 2], timeout=WAIT_MS)
    assert page.evaluate("window.sameDocument") is True
    assert tile_number(page, "gen-tps") > 0
    assert tile_number(page, "ttft-p50") > 0
    assert "tok/s" in page.text_content("[data-testid=tile-gen-tps] .value")

    # a few concurrent bursts give the plots some shape, and the page follows them all
    prompts = ["Once upon a time", "def main():", "Dear Sir,", "The weather today"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        for max_tokens in (8, 16, 12):
            list(pool.map(lambda p, n=max_tokens: ui_server.client().completions.create(
                model=model, prompt=p, max_tokens=n, temperature=0), prompts))
            page.wait_for_timeout(700)
    page.wait_for_function(
        """n => Number(document.querySelector('[data-testid=tile-finished]').dataset.value) >= n
               && Number(document.getElementById('plot-tokens').dataset.points) >= 4""",
        arg=finished_before + 2 + 3 * len(prompts), timeout=WAIT_MS)
    page.get_by_test_id("window-60").check()  # the shortest window fills the plots best
    page.wait_for_selector("main[data-window='60']", timeout=WAIT_MS)
    page.screenshot(path=str(screenshots / "dashboard.png"), full_page=True)
    assert page.console_errors == []


def test_window_selector_works_from_the_keyboard(page, ui_server):
    open_dashboard(page, ui_server)
    page.focus("nav a[aria-current=page]")
    page.keyboard.press("Tab")  # into the radio group, on its checked choice
    assert page.evaluate("document.activeElement.value") == "300"
    requested = []
    page.on("request", lambda r: requested.append(r.url) if "/dashboard/data" in r.url else None)
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("main[data-window='900']", timeout=WAIT_MS)
    assert page.is_checked("[data-testid=window-900]")
    assert any(url.endswith("window=900") for url in requested)
    assert "15 minutes" in page.text_content("#h-latency")
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    page.wait_for_selector("main[data-window='60']", timeout=WAIT_MS)
    assert "last minute" in page.text_content("#h-latency")
    assert page.console_errors == []


def test_a_failing_data_route_shows_a_banner_until_it_answers_again(page, ui_server):
    open_dashboard(page, ui_server)
    banner = "[data-testid=banner]"
    assert page.get_attribute(".banner-region", "aria-live") == "polite"
    assert page.locator("[aria-live]").count() == 1  # the banner only, not every tile
    body = {"error": {"message": "metrics are disabled", "type": "NotFoundError",
                      "param": None, "code": 404}}
    page.route("**/dashboard/data*", lambda route: route.fulfill(status=404, json=body))
    page.wait_for_selector(f"{banner}:not([hidden])", timeout=WAIT_MS)
    assert "--disable-metrics" in page.text_content(banner)
    page.unroute("**/dashboard/data*")
    page.wait_for_selector(f"{banner}[hidden]", timeout=WAIT_MS, state="attached")

    page.route("**/dashboard/data*", lambda route: route.abort())  # the server gone
    page.wait_for_selector(f"{banner}:not([hidden])", timeout=WAIT_MS)
    assert "Cannot reach the server" in page.text_content(banner)
    assert page.get_attribute("[data-testid=live]", "data-state") == "down"
    page.unroute("**/dashboard/data*")
    page.wait_for_selector(f"{banner}[hidden]", timeout=WAIT_MS, state="attached")
    assert page.get_attribute("[data-testid=live]", "data-state") == "live"
    # the browser itself logs the failed loads; the page's own code logs nothing
    assert [e for e in page.console_errors if "Failed to load resource" not in e] == []


def test_behind_an_api_key_the_page_loads_and_names_the_model(page, keyed_server, api_key):
    assert httpx.get(f"{keyed_server.url}/v1/models", timeout=10).status_code == 401
    served = httpx.get(f"{keyed_server.url}/v1/models", timeout=10,
                       headers={"Authorization": f"Bearer {api_key}"}).json()["data"][0]["id"]
    open_dashboard(page, keyed_server)
    page.wait_for_function("id => document.getElementById('model-name').textContent === id",
                           arg=served, timeout=WAIT_MS)
    assert page.is_hidden("[data-testid=banner]")
    assert page.locator("#key-banner, input[type=password]").count() == 0  # asks no key
    assert [e for e in page.console_errors if "Failed to load resource" not in e] == []


def test_accessibility_basics(page, ui_server):
    open_dashboard(page, ui_server)
    assert page.evaluate("document.documentElement.lang") == "en"
    assert page.locator("header").count() == 1 and page.locator("main").count() == 1
    assert page.locator("h1").count() == 1
    headings = page.locator("main section h2").all_text_contents()
    assert len(headings) == 4
    unnamed = page.evaluate("""() => [...document.querySelectorAll('main section')]
        .filter(s => !s.getAttribute('aria-labelledby')).length""")
    assert unnamed == 0
    # each tile is a term and its value, in a description list
    assert page.evaluate("""() => [...document.querySelectorAll('.tile')]
        .every(t => t.parentElement.tagName === 'DL' && t.querySelector('dt')
               && t.querySelector('dd'))""")
    assert page.evaluate("""() => [...document.querySelectorAll('canvas')]
        .every(c => c.getAttribute('role') === 'img' && c.getAttribute('aria-label'))""")
    assert page.evaluate("""() => [...document.querySelectorAll('input')]
        .every(i => i.labels.length > 0)""")
