"""Tool-call parsers of the second group of families: the vectors of tool_vectors_b.py,
whole and replayed as a stream, each family's own rules, and auto-detection from the
families' real chat templates."""

from __future__ import annotations

import json

import pytest
from tool_parser_utils import TOOLS, check_vector
from tool_vectors_b import VECTORS_B

from vllmpy.entrypoints.openai.tool_parsers import detect_tool_parser, get_tool_parser


def _ids(vectors):
    return [f"{v[0]}-{i}" for i, v in enumerate(vectors)]


@pytest.mark.parametrize("name, text, content, calls", VECTORS_B, ids=_ids(VECTORS_B))
def test_vectors_whole_and_streamed(name, text, content, calls):
    check_vector(name, text, content, calls)
