"""Without CUDA, the Triton kernels run under Triton's interpreter. Triton reads the
variable when it is first imported, so it is set here, before any test module (or the
package code they import) can import Triton."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser):
    group = parser.getgroup("vllmpy load tests")
    group.addoption("--soak-requests", type=int, default=10_000,
                    help="requests in the soak test (default 10,000)")
    group.addoption("--abort-requests", type=int, default=1_000,
                    help="aborted streams in the abort test (default 1,000)")


# ---- figures: numbers a test measured, printed together at the end of the run ---------

_FIGURES: list[tuple[str, str]] = []


@pytest.fixture
def figures(request):
    """``figures(text)`` records one line of measured numbers under the test's name; every
    line is printed in a "figures" section after the run (the suite's own report of what it
    measured: fault, load and fuzz results)."""
    def record(text: str) -> None:
        _FIGURES.append((request.node.nodeid, text))
    return record


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("figures")
        for nodeid, text in _FIGURES:
            terminalreporter.write_line(f"{nodeid}: {text}")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """A small random-weight Llama over SmolLM2's real tokenizer and chat template (see
    server_utils.write_tiny_chat_model); serve it with server_utils.TINY_SERVER."""
    from server_utils import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
