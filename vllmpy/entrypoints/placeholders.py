"""Commands whose implementation has not landed yet: each says so and exits 1."""

from __future__ import annotations

import sys


def _not_yet(name: str) -> int:
    print(f"{name}: not available in this version of vllmpy yet; use vllm-cli or "
          "vllmpy.LLM", file=sys.stderr)
    return 1


def bench_main() -> int:
    return _not_yet("vllm-bench")


def tokenize_main() -> int:
    return _not_yet("vllm-tokenize")
