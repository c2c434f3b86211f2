"""vllm-cli --stream --repeat N: one load, N streamed runs, each reported on stderr in the
two-line format of the non-stream --repeat, counting the token ids that were streamed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from vllmpy.entrypoints import cli
from vllmpy.loader.pypi_weights import fetch
from vllmpy.outputs import CompletionOutput, RequestOutput

RUN = re.compile(r"^vllm-cli: run=(\d+)/(\d+) finish_reason=(\w+) prompt_tokens=(\d+) "
                 r"completion_tokens=(\d+) secs=(\d+\.\d{3}) tok_s=(\d+\.\d{3})$")
TIMES = re.compile(r"^vllm-cli: run=(\d+)/(\d+) generate_start_unix=(\d+\.\d{6}) "
                   r"generate_end_unix=(\d+\.\d{6})$")


class StreamingStub:
    """Stands in for LLM: each stream sends three deltas whose token ids (2, 0 and 3 of
    them) have nothing to do with how their text would tokenize."""

    loads = 0
    DELTAS = (("Par", [11, 12], None), ("", [], None), ("is.", [13, 14, 15], "length"))

    def __init__(self, **engine_args) -> None:
        StreamingStub.loads += 1

    def generate_stream(self, prompt, params):
        for text, ids, finish in self.DELTAS:
            yield RequestOutput("r", prompt, [1, 2, 3, 4], [CompletionOutput(
                0, text, ids, finish_reason=finish)], finished=finish is not None)


def report_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("vllm-cli: run=")]


def test_stream_repeat_loads_once_and_counts_streamed_ids(monkeypatch, capsys):
    import vllmpy.engine.llm

    monkeypatch.setattr(vllmpy.engine.llm, "LLM", StreamingStub)
    StreamingStub.loads = 0
    assert cli.main(["--prompt", "The capital of France is", "--stream", "--repeat", "3"]) == 0
    out, err = capsys.readouterr()
    assert StreamingStub.loads == 1
    assert out == "Paris.\n" * 3
    lines = report_lines(err)
    assert len(lines) == 6 and "not supported" not in err
    for run in range(3):
        first, second = RUN.match(lines[2 * run]), TIMES.match(lines[2 * run + 1])
        assert first and second, lines
        assert first.groups()[:5] == (str(run + 1), "3", "length", "4", "5")
        assert second.groups()[:2] == (str(run + 1), "3")
        assert float(second.group(3)) <= float(second.group(4))
        secs, rate = float(first.group(6)), float(first.group(7))
        assert secs == 0 or rate == pytest.approx(5 / secs, rel=0.01, abs=0.002)


def test_an_unfinished_stream_reports_no_completion_tokens(monkeypatch, capsys):
    import vllmpy.engine.llm

    class Cut(StreamingStub):
        DELTAS = (("Par", [11, 12], None),)

    monkeypatch.setattr(vllmpy.engine.llm, "LLM", Cut)
    assert cli.main(["--prompt", "x", "--stream", "--repeat", "1"]) == 0
    first = RUN.match(report_lines(capsys.readouterr().err)[0])
    assert first and first.group(3, 5) == ("None", "0")


@pytest.mark.slow
def test_stream_repeat_on_the_real_model():
    model = str(fetch("smollm2", quiet=True))
    common = ["--model", model, "--prompt", "The capital of France is", "--max-tokens", "4",
              "--device", "cpu", "--num-blocks", "8", "--max-model-len", "64"]

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vllmpy.entrypoints.cli", *common, *extra],
                              capture_output=True, text=True, timeout=300, env=os.environ)

    streamed = run("--stream", "--repeat", "2")
    assert streamed.returncode == 0, streamed.stderr
    lines = report_lines(streamed.stderr)
    assert len(lines) == 4
    for run_no in (1, 2):
        first = RUN.match(lines[2 * run_no - 2])
        assert first and TIMES.match(lines[2 * run_no - 1]), lines
        # greedy, 4 tokens asked, none of them a stop: finish by length after exactly 4
        assert first.groups()[:5] == (str(run_no), "2", "length", "5", "4")
    # two greedy runs print the same completion, each followed by a newline
    half = len(streamed.stdout) // 2
    once = streamed.stdout[:half]
    assert streamed.stdout == once * 2 and once.endswith("\n") and once.strip()
