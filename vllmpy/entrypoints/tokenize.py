"""vllm-tokenize: a tokenizer smoke test over a text corpus.

    vllm-tokenize <model dir | tokenizer.json | model.gguf> <corpus.txt>

Loads the tokenizer the engine would use, tokenizes the corpus as one text and line by
line (no special tokens added), prints counts, timings and tokens/s, and checks that
decode(encode(text)) gives the text back, for the whole corpus and for every line. Exit
status: 0 when every round trip holds, 1 when one does not, 2 for bad arguments.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from vllmpy.entrypoints.arg_utils import OneLineArgumentParser

PROG = "vllm-tokenize"
LABEL_WIDTH = 43




def make_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=PROG,
                description="Tokenize a corpus, time it and check the round trip.")
    p.add_argument("tokenizer", help="model directory or tokenizer.json (tokenizer.json and "
                                     "tokenizer_config.json), or a .gguf file")
    p.add_argument("corpus", help="UTF-8 text file")
    return p


def load(path: str) -> Any:
    """The tokenizer at ``path``; ValueError naming what is wrong."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        from vllmpy.tokenizer.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if os.path.isfile(path) and os.path.basename(path) == "tokenizer.json":
        path = os.path.dirname(path) or "."
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a model directory, tokenizer.json or .gguf file")
    from vllmpy.tokenizer.hf import load_hf_tokenizer

    return load_hf_tokenizer(path)


def read_corpus(path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"corpus not found: {path}")
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {path} is not UTF-8: {e}") from None


def _line(label: str, value: Any) -> str:
    return f"{label:<{LABEL_WIDTH - 1}} {value}"


def _rate(tokens: int, secs: float) -> str:
    return f"{tokens / secs:.0f}" if secs > 0 else "inf"


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        tokenizer = load(args.tokenizer)
        text = read_corpus(args.corpus)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2

    start = time.perf_counter()
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole_secs = time.perf_counter() - start
    lines = text.split("\n")
    start = time.perf_counter()
    line_ids = [tokenizer.encode(line, add_special_tokens=False) for line in lines]
    line_secs = time.perf_counter() - start
    line_tokens = sum(len(x) for x in line_ids)

    whole_ok = tokenizer.decode(ids, skip_special_tokens=False) == text
    bad_lines = [i for i, (line, x) in enumerate(zip(lines, line_ids), 1)
                 if tokenizer.decode(x, skip_special_tokens=False) != line]

    print(_line("Tokenizer:", f"{args.tokenizer} ({tokenizer.vocab_size} tokens)"))
    print(_line("Corpus:", args.corpus))
    print(_line("Characters:", len(text)))
    print(_line("Lines:", len(lines)))
    print(_line("Tokens (whole file):", len(ids)))
    print(_line("Seconds (whole file):", f"{whole_secs:.4f}"))
    print(_line("Tokens/s (whole file):", _rate(len(ids), whole_secs)))
    print(_line("Tokens (per line, summed):", line_tokens))
    print(_line("Seconds (per line):", f"{line_secs:.4f}"))
    print(_line("Tokens/s (per line):", _rate(line_tokens, line_secs)))
    print(_line("Round trip (whole file):", "ok" if whole_ok else "MISMATCH"))
    print(_line("Round trip (mismatching lines):", len(bad_lines)))
    for n in bad_lines[:3]:
        print(f"{PROG}: line {n} does not round-trip: {lines[n - 1][:80]!r}", file=sys.stderr)
    return 0 if whole_ok and not bad_lines else 1


if __name__ == "__main__":
    raise SystemExit(main())
