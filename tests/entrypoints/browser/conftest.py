"""Browser tests: Debian's Chromium driven by Playwright (no browser download), against
real vllm-server processes on 127.0.0.1.

``scripts/setup.sh test`` installs both. Where Chromium is missing the tests skip with a
reason, unless ``VLLMPY_REQUIRE_BROWSER=1`` (set by CI), which turns that into a failure.
Screenshots go to ``test-output/browser/`` (``VLLMPY_TEST_OUTPUT`` moves the folder).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from server_utils import TINY_SERVER, start_server

from vllmpy.loader.pypi_weights import fetch

REPO = Path(__file__).resolve().parents[3]
# Chromium as root in a container: no sandbox; no calls home (the network may be closed).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]
API_KEY = "sk-browser-test"


def chromium_path() -> str | None:
    return os.environ.get("VLLMPY_CHROMIUM") or shutil.which("chromium") or shutil.which(
        "chromium-browser")


@pytest.fixture(scope="session")
def screenshots() -> Path:
    out = Path(os.environ.get("VLLMPY_TEST_OUTPUT", REPO / "test-output")) / "browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser():
    exe = chromium_path()
    if exe is None:
        message = ("no Chromium found (install Debian's chromium, or set VLLMPY_CHROMIUM); "
                   "scripts/setup.sh test installs it")
        if os.environ.get("VLLMPY_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A fresh tab at a desktop size; console errors fail the test that opened it."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.console_errors = errors
    yield tab
    context.close()


@pytest.fixture(scope="module")
def ui_server():
    """vllm-server on the real SmolLM2-135M-Instruct GGUF, as a newcomer starts it."""
    s = start_server("--model", str(fetch("smollm2", quiet=True)), "--device", "cpu",
                     "--max-model-len", "2048", "--num-blocks", "256")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="module")
def keyed_server(tiny_chat_model):
    """A small random-weight model behind --api-key."""
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--api-key", API_KEY,
                     "--max-model-len", "1024")
    yield s
    s.stop()
