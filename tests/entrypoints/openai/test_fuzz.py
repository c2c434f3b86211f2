"""Fuzzing with schemathesis, with its figures: cases generated from OpenAI's own spec
(the operations this server implements) and from the server's /openapi.json (every
operation), sent over a socket. No case may get a server error (5xx), and every error
answers in OpenAI's shape with ``code`` equal to the status.

Generation is seeded, so a failure replays. The default-length cap keeps a case that
leaves max_tokens unset from running to the context limit.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from server_utils import TINY_SERVER, start_server

# OpenAI's published spec, cut to the operations this server implements (see
# data/make_openai_subset.py)
SPEC = Path(__file__).parent / "data" / "openai-subset.json"
OPENAI_OPERATIONS = ("createCompletion", "createChatCompletion", "listModels")
CASES_PER_OPERATION = {"openai": 300, "own": 40}

_tally: dict[str, Counter] = {"openai": Counter(), "own": Counter()}


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_model):
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--num-blocks", "256",
                     "--max-model-len", "512", "--max-num-seqs", "32",
                     "--disable-log-requests", env={"VT_SERVER_MAX_NEW_TOKENS": "4"})
    yield s
    s.stop()


def check(response, tally: Counter) -> None:
    """No server error; an error body is OpenAI's shape and names its own status."""
    tally["cases"] += 1
    tally[f"{response.status_code // 100}xx"] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], body
        assert isinstance(error["type"], str) and error["type"], body
        assert error["param"] is None or isinstance(error["param"], str), body
        assert error["code"] == response.status_code, body


def fuzz(schema, base_url: str, cases_per_operation: int, tally: Counter) -> None:
    """Send ``cases_per_operation`` generated cases to each operation of ``schema``: half
    valid by the schema, half not (a wrong type, a value out of range, a missing field)."""
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [schemathesis.GenerationMode.POSITIVE]
        if len(operation.body) or list(operation.iter_parameters()):
            modes.append(schemathesis.GenerationMode.NEGATIVE)  # something to get wrong
        for mode in modes:
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            @hypothesis.settings(max_examples=cases_per_operation // len(modes), deadline=None,
                                 derandomize=True, database=None, phases=[
                                     hypothesis.Phase.explicit, hypothesis.Phase.generate],
                                 suppress_health_check=list(hypothesis.HealthCheck))
            def send(case) -> None:
                check(case.call(base_url=base_url, timeout=60), tally)

            send()


def test_openai_spec_cases_get_no_server_error(fuzz_server):
    schema = schemathesis.openapi.from_path(str(SPEC)).include(
        operation_id=list(OPENAI_OPERATIONS))
    fuzz(schema, f"{fuzz_server.url}/v1", CASES_PER_OPERATION["openai"], _tally["openai"])


def test_own_openapi_cases_get_no_server_error(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    fuzz(schema, fuzz_server.url, CASES_PER_OPERATION["own"], _tally["own"])


def test_fuzz_figures(fuzz_server, figures):
    """Runs after the fuzz tests of this module: their case counts, and a check that the
    server is still up."""
    import httpx

    total = sum(t["cases"] for t in _tally.values())
    for name, tally in _tally.items():
        figures(f"{name} spec: {tally['cases']} cases, {tally['2xx']} 2xx, "
                f"{tally['4xx']} 4xx, {tally['5xx']} 5xx")
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200
    assert total >= 1000, _tally
