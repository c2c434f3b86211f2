"""The browser pages the server ships: the playground at ``/`` and the live dashboard at
``/dashboard``, plain HTML, CSS and JavaScript from ``static/`` (no build step, nothing
fetched from elsewhere).

The pages call the server's own routes: the playground the OpenAI routes (with the API
key the user types in, kept only in the browser tab), the dashboard ``/dashboard/data``,
which is ``/metrics``'s numbers turned into rates and windowed percentiles by
``vllmpy.metrics.history``. ``--disable-web-ui`` leaves all of them unrouted.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

STATIC_DIR = resources.files("vllmpy.entrypoints.openai") / "static"
# Pages and assets load without the API key (the playground asks for it); /dashboard/data
# carries /metrics's numbers, which are open too.
WEB_UI_PATHS = frozenset({"/", "/dashboard", "/dashboard/data"})
STATIC_PREFIX = "/static/"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml",
                 ".png": "image/png", ".ico": "image/x-icon"}
# A page that stays open reads new assets after an upgrade.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
# The longest window /dashboard/data answers for, in seconds.
MAX_WINDOW_S = 3600.0


def is_web_ui_path(path: str) -> bool:
    return path in WEB_UI_PATHS or path.startswith(STATIC_PREFIX)


def static_file(name: str) -> Response | None:
    """One file of ``static/`` by its bare name, or None (names with a folder part, or
    unknown ones, are never looked up)."""
    if "/" in name or "\\" in name or name.startswith("."):
        return None
    suffix = name[name.rfind("."):] if "." in name else ""
    if suffix not in CONTENT_TYPES:
        return None
    entry = STATIC_DIR / name
    if not entry.is_file():
        return None
    return Response(entry.read_bytes(), media_type=CONTENT_TYPES[suffix], headers=HEADERS)


def add_web_ui(app: FastAPI, history, error) -> None:
    """Route the pages on ``app``. ``history`` is the dashboard's MetricsHistory, or None
    when metrics are off; ``error(status, message, param)`` builds an OpenAI error."""

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        return _page("index.html", error)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return _page("dashboard.html", error)

    @app.get("/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        found = static_file(name)
        if found is None:
            return error(404, f"no static file {name!r}", None)
        return found

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(request: Request) -> Response:
        if history is None:
            return error(404, "metrics are disabled (--disable-metrics), and the dashboard "
                              "reads them", None)
        raw = request.query_params.get("window", "300")
        try:
            window = float(raw)
        except ValueError:
            window = float("nan")
        if not 0 < window <= MAX_WINDOW_S:
            return error(400, f"window must be a number of seconds in (0, {MAX_WINDOW_S:g}], "
                              f"got {raw!r}", "window")
        return JSONResponse(history.view(window), headers=HEADERS)


def _page(name: str, error) -> Response:
    found = static_file(name)
    if found is None:  # an install without its package data
        return error(500, f"the web UI's {name} is missing from this install", None)
    return found
