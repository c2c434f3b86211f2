"""The text-splitting rule behind each GGUF `tokenizer.ggml.pre` name.

Before byte-level BPE runs, text is cut into pieces and BPE merges only inside a piece. A GGUF
names its cutting rule with `tokenizer.ggml.pre`; llama.cpp (`llama-vocab.cpp`) maps each name
to a list of regexes applied in order: each one splits every piece the previous ones left, and
both its matches and the text between them become pieces (tokenizers' `Split(behavior=
"isolated")`). `SPLIT_RULES` holds that list for every name we accept, written for the
tokenizers library's regex engine (Oniguruma) with the same meaning as llama.cpp's:

- Where llama.cpp rewrote an original pattern (its std::regex has no `(?i:...)` and no `\\p{Lu}`)
  we use its rewrite, since that is what llama.cpp runs: contractions as `'[sS]|'[tT]...`, and
  for the GPT-4o family "an upper-case letter" as `(?=\\p{L})[^a-z]` and "a lower-case letter"
  as `(?=\\p{L})[^A-Z]`. So every non-ASCII letter counts as both cases there, and combining
  marks (`\\p{M}`) are not part of a letter run: "ÉCOLE" splits as "É" + "COLE" and "e" + U+0301
  as "e" + U+0301, where o200k's original pattern keeps each whole.
- `\\s` is the same 25 White_Space code points in both engines. llama.cpp's std::wregex path sees
  every non-ASCII whitespace character as U+000B, so a bracket range written over one (the
  deepseek-llm classes U+3000-U+3002 and U+0800-U+4E00) never matches it there: we leave the
  whitespace code points out of such ranges (`_ranges`).
- Character categories: llama.cpp's tables are Unicode 15.1, Oniguruma's Unicode 16. The few
  thousand characters new in Unicode 16 (U+A7CB, U+1C89, ...) are letters, digits or marks here
  and unassigned in llama.cpp, so text using them may split differently.

Names, rules, and the oracle each is checked against (tests/tokenizer/test_gguf_pre_tokenizers.py):

| pre | rule | oracle |
|---|---|---|
| qwen2 | Qwen2: one digit at a time, letters with one leading non-letter | llama.cpp's golden vectors (ggml-vocab-qwen2), transformers on Qwen2.5-Coder |
| qwen35 | Qwen2's, with combining marks inside letter runs | llama.cpp's golden vectors (ggml-vocab-qwen35), and test-tokenizer-0 on more texts (golden file) |
| llama-bpe | Llama 3: Qwen2's with digits in groups of up to three; whole-token pieces unmerged | llama.cpp's golden vectors (ggml-vocab-llama-bpe) |
| gpt-4o, llama4, kanana2, talkie | o200k: case-aware letter runs with a contraction suffix, `\\p{N}{1,3}` | llama.cpp's test-tokenizer-0 on Tekken's vocabulary (golden file); Tekken's pattern for the shared classes |
| deepseek-llm | DeepSeek LLM's six stages: newlines, cased-letter runs, ASCII/full-width punctuation, trailing space, CJK, digit runs | llama.cpp's golden vectors (ggml-vocab-deepseek-llm), and test-tokenizer-0 on more texts (golden file) |
| deepseek-v3, joyai-llm | DeepSeek V3's three stages: `\\p{N}{1,3}`, CJK/kana runs, then the main alternation | DeepSeek-V3's tokenizer.json; llama.cpp's test-tokenizer-0 (golden file) |
| laguna | newline runs apart, then Qwen2's | llama.cpp's test-tokenizer-0 on the Qwen2 vocabulary (golden file) |
| gpt-2 | GPT-2's own regex | llama.cpp's golden vectors (ggml-vocab-gpt-2) |
| smollm, default | GPT-2's own regex (transformers' choice, see gguf_tokenizer.py) | transformers: on SmolLM2 (test_gguf_tokenizer.py) / on a small written vocabulary |

Where transformers' GGUF conversion differs (we follow llama.cpp for these names): it has no
rule for deepseek-llm, deepseek-v3, joyai-llm or laguna and falls back to GPT-2's regex; for
the GPT-4o family it runs o200k's original pattern (see the first point above); and for
llama-bpe it merges a piece that is itself a vocabulary token, where llama.cpp (and Llama 3's
own tokenizer.json, `ignore_merges`) take the token whole: "Cửa Việt" ends in " Việt" (one
token) in llama.cpp and in four tokens in transformers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# The code points `\s` matches (Unicode White_Space), as llama.cpp lists them.
_WHITESPACE = frozenset({0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680,
                         *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000})


def _ranges(spans: Iterable[tuple[int, int]]) -> str:
    """The inside of a bracket class for inclusive code point spans, whitespace left out."""
    parts = []
    for lo, hi in spans:
        start = None
        for cp in [*range(lo, hi + 1), None]:
            if cp is not None and cp not in _WHITESPACE:
                start = cp if start is None else start
                continue
            if start is not None:
                end = (cp if cp is not None else hi + 1) - 1
                parts.append(_escape(start) if start == end else f"{_escape(start)}-{_escape(end)}")
                start = None
    return "".join(parts)


def _escape(cp: int) -> str:
    char = chr(cp)
    return "\\" + char if char in "\\]^-[" else char


# Contractions, the way transformers writes them (the existing names keep it) and llama.cpp's
# rewrite (the new names); they differ only on "'ſ" (U+017F, which folds to s).
_CONTRACTIONS_CI = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# After the contractions: letters with one leading non-letter, digits, punctuation runs with
# a leading space and trailing newlines, newline runs, then the remaining whitespace.
_QWEN2_TAIL = (r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
QWEN2_SPLIT = _CONTRACTIONS_CI + _QWEN2_TAIL
LLAMA3_SPLIT = _CONTRACTIONS_CI + _QWEN2_TAIL.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
QWEN35_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# GPT-4o / o200k, in llama.cpp's rewrite: a run of "upper" letters then "lower" ones (or the
# reverse emphasis), each with an optional contraction suffix.
_UPPER = r"(?:(?=\p{L})[^a-z])"
_LOWER = r"(?:(?=\p{L})[^A-Z])"
GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# CJK ideographs U+4E00-U+9FA5, hiragana, katakana.
_CJK_KANA = _ranges([(0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF)])
DEEPSEEK_V3_SPLIT = (
    r"\p{N}{1,3}",
    f"[{_CJK_KANA}]+",
    # one ASCII punctuation mark glued to a run of ASCII letters (a code identifier), a letter
    # run (marks included) with one leading non-letter, punctuation/symbol runs, whitespace.
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# DeepSeek LLM's cased letters: the scripts with upper/lower case (Latin, Greek, Cyrillic,
# Armenian, Georgian, Cherokee, Glagolitic, Coptic, Deseret, Osage, ...), as its tokenizer lists them.
_DEEPSEEK_LETTERS = _ranges([
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
    (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
    (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
    (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
    (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
    (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
])
# ASCII punctuation and letters, full-width forms, curly quotes, the ideographic comma and stop.
_DEEPSEEK_PUNCT = _ranges([(0x21, 0x2F), (0x3A, 0x7E), (0xFF01, 0xFF0F), (0xFF1A, 0xFF5E),
                           (0x2018, 0x201F), (0x3000, 0x3002)])
# CJK ideographs, everything from U+0800 up to them, Hangul syllables and U+D7B0-U+D7FF.
_DEEPSEEK_CJK = _ranges([(0x4E00, 0x9FA5), (0x0800, 0x4E00), (0xAC00, 0xD7FF)])
DEEPSEEK_LLM_SPLIT = (
    r"[\r\n]",
    rf"\s?[{_DEEPSEEK_LETTERS}]+",
    rf"\s?[{_DEEPSEEK_PUNCT}]+",
    r"\s+$",
    f"[{_DEEPSEEK_CJK}]+",
    r"\p{N}+",
)


@dataclass(frozen=True)
class SplitRule:
    """How one `tokenizer.ggml.pre` name cuts text before BPE.

    `patterns` split in order (see the module docstring); an empty tuple means GPT-2's own
    regex (tokenizers' `ByteLevel(use_regex=True)`). With `ignore_merges`, a piece that is a
    vocabulary token is that token, whatever the merges would make of it.
    """

    patterns: tuple[str, ...]
    ignore_merges: bool = False

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        """Split by `patterns`, then map bytes to the byte-level alphabet."""
        if not self.patterns:
            return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        return pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(p), behavior="isolated") for p in self.patterns),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])


_GPT2 = SplitRule(())
_GPT4O = SplitRule((GPT4O_SPLIT,))
_DEEPSEEK_V3 = SplitRule(DEEPSEEK_V3_SPLIT)

# tokenizer.ggml.pre -> its rule.
SPLIT_RULES: dict[str, SplitRule] = {
    "qwen2": SplitRule((QWEN2_SPLIT,)),
    "qwen35": SplitRule((QWEN35_SPLIT,)),
    "llama-bpe": SplitRule((LLAMA3_SPLIT,), ignore_merges=True),
    "gpt-4o": _GPT4O,
    "llama4": _GPT4O,
    "kanana2": _GPT4O,
    "talkie": _GPT4O,
    "joyai-llm": _DEEPSEEK_V3,
    "deepseek-llm": SplitRule(DEEPSEEK_LLM_SPLIT),
    "deepseek-v3": _DEEPSEEK_V3,
    "laguna": SplitRule((r"[^\n]+|\n+", _CONTRACTIONS + _QWEN2_TAIL)),
    "smollm": _GPT2,
    "gpt-2": _GPT2,
    "default": _GPT2,
}
