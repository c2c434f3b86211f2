"""Tool-call vectors of the second group of families (see test_tool_parsers_b.py):
(parser, model text, expected content, expected [(name, arguments as a JSON value)])."""

from __future__ import annotations

VECTORS_B: list[tuple[str, str, str | None, list[tuple[str, object]]]] = []
