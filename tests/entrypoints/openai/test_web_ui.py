"""The web UI's routes: pages and assets served from the package, open without the API
key, never a path outside ``static/``; the OpenAI routes as they were."""

from __future__ import annotations

import re

import httpx
import pytest

from vllmpy.entrypoints.openai.web_ui import STATIC_DIR, static_file


def test_every_asset_a_page_names_is_in_the_package():
    for page in ("index.html", "dashboard.html"):
        html = (STATIC_DIR / page).read_text()
        for name in re.findall(r'(?:src|href)="/static/([^"]+)"', html):
            assert static_file(name) is not None, f"{page} names missing /static/{name}"
        assert "http://" not in html and "https://" not in html  # nothing from elsewhere


@pytest.mark.parametrize("name", ["../app.py", "..", ".hidden.js", "sub/x.js", "app.py",
                                  "missing.js", "index", "a\\b.css"])
def test_names_outside_the_folder_or_of_other_kinds_are_never_served(name):
    assert static_file(name) is None


def test_static_types():
    assert static_file("playground.js").media_type.startswith("text/javascript")
    assert static_file("playground.css").media_type.startswith("text/css")
    assert static_file("favicon.svg").media_type == "image/svg+xml"


@pytest.mark.slow
def test_pages_over_http(server):
    page = httpx.get(f"{server.url}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/playground.js"' in page.text
    js = httpx.get(f"{server.url}/static/playground.js", timeout=30)
    assert js.status_code == 200 and js.headers["cache-control"] == "no-cache"
    missing = httpx.get(f"{server.url}/static/nothing.js", timeout=30)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no static file 'nothing.js'"
    # an encoded "../" reaches the route as a name with a slash, and is refused
    escaped = httpx.get(f"{server.url}/static/..%2Fapp.py", timeout=30)
    assert escaped.status_code == 404
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert "/" not in schema["paths"] and "/dashboard" not in schema["paths"]
