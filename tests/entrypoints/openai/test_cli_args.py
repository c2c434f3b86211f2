"""vllm-server's flag parsing (no engine started)."""

from __future__ import annotations

import pytest

from vllmpy.entrypoints.openai.cli_args import default_served_model_name, parse_server_args


def test_defaults_follow_the_usage_doc(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    a = parse_server_args([])
    assert (a.host, a.port, a.max_num_seqs, a.block_size, a.max_log_len) == \
        ("0.0.0.0", 8000, 32, 32, 256)
    assert a.log_requests and a.enable_metrics and a.enable_thinking is None
    assert a.api_key is None and a.num_blocks is None


def test_paired_flags_and_api_key_sources(monkeypatch):
    a = parse_server_args(["--disable-log-requests", "--disable-metrics", "--no-enable-thinking"])
    assert not a.log_requests and not a.enable_metrics and a.enable_thinking is False
    assert parse_server_args(["--enable-thinking"]).enable_thinking is True
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert parse_server_args([]).api_key == "from-env"
    assert parse_server_args(["--api-key", "flag"]).api_key == "flag"


@pytest.mark.parametrize("argv, needle", [
    (["--tensor-parallel-size", "2"], "server: unknown argument '--tensor-parallel-size'"),
    (["--scheduling-policy", "sjf"],
     "server: argument --scheduling-policy: invalid choice: 'sjf'"),
    (["--port", "x"], "--port"),
    (["--max-log-len", "-1"], "--max-log-len"),
])
def test_refusals_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_inert_flags_print_one_notice_each(capsys):
    parse_server_args(["--trust-remote-code", "--enable-auto-tool-choice"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert err[0].startswith("server: accepted '--enable-auto-tool-choice'")
    assert err[1].startswith("server: accepted '--trust-remote-code'")


def test_served_model_name_is_the_basename():
    assert default_served_model_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert default_served_model_name("/x/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
