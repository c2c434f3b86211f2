"""The tokenizer of a GGUF file, rebuilt from its `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary (`tokenizer.ggml.tokens`), each
token's type, the special token ids and the kind of tokenizer (`tokenizer.ggml.model`). Two kinds
are built, any other is refused by name:

- "llama", SentencePiece (Gemma, Phi-3, Llama 2): scores instead of merges, byte-fallback tokens,
  "▁" for a space. Built to give llama.cpp's ids; gguf_spm.py says how and where it differs.
- "gpt2", byte-level BPE, with merges and the name of the text-splitting rule
  (`tokenizer.ggml.pre`); the rest of this docstring is about it.

For "gpt2" we rebuild the tokenizer Hugging Face transformers builds from the same
file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), except that the split rules of the
names transformers does not know, or splits otherwise than llama.cpp, are llama.cpp's (gguf_pre.py
lists every rule, says where transformers differs, and names the oracle each is checked against):

- vocabulary: tokens spelled in the byte alphabet as they are, added tokens written in plain text
  (DeepSeek's `<｜begin▁of▁sentence｜>`) as they are too, any other token (rare) re-spelled byte by
  byte from its UTF-8 text (see `_vocabulary`);
- control tokens (type 3) become special added tokens (matched whole in text, dropped by
  `decode(skip_special_tokens=True)`); user-defined tokens (type 4, e.g. `<tool_call>`) become
  plain added tokens (matched whole, kept on decode); BOS/EOS/UNK/PAD are special too;
- the split rule chosen by `tokenizer.ggml.pre` (`gguf_pre.SPLIT_RULES`); any other name is
  refused by name;
- BOS/EOS added by `encode(add_special_tokens=True)` only when `tokenizer.ggml.add_bos_token` /
  `add_eos_token` say so (both default to false for a byte-level vocabulary).

`smollm` note: SmolLM's own tokenizer.json (and llama.cpp) split every digit off before the GPT-2
regex; transformers' GGUF conversion does not, and uses the plain GPT-2 regex. We follow
transformers. The ids differ only before a numeric character: after a run of two or more
whitespace characters, and after a single space when the numeral is not ASCII (² ½ ١). See
tests/tokenizer/test_gguf_tokenizer.py::test_smollm_digit_split_divergence.
`qwen2` note: Qwen2's own tokenizer.json NFC-normalizes text first; transformers' conversion (and
llama.cpp) do not, so text that is not in NFC (e.g. "e" + U+0301) differs. We follow transformers.
`default` note (also a file without `tokenizer.ggml.pre`): transformers uses the plain GPT-2 regex;
llama.cpp's `default` splits punctuation runs and digits off first. We follow transformers.
`llama-bpe` note: we follow llama.cpp in taking a piece that is a whole vocabulary token as that
token (see gguf_pre.py). When the file has no `tokenizer.ggml.add_bos_token`, llama.cpp adds BOS
for this name and we, like transformers, do not; converted Llama 3 files carry the key.
Added tokens in plain text: transformers re-spells them byte by byte and then leaves a control
one out or appends it past the vocabulary under a new id; we keep each at its own id and match it
whole in text, as llama.cpp does (no file transformers is compared on has one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from vllmpy.loader.gguf_file import GGUFFile, open_gguf_file
from vllmpy.tokenizer.gguf_pre import SPLIT_RULES
from vllmpy.tokenizer.gguf_spm import spm_backend, token_attrs, token_texts
from vllmpy.tokenizer.tokenizer import Tokenizer, bos_eos_post_processor, byte_level_alphabet

# llama.cpp's token types (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

SUPPORTED_PRE = tuple(SPLIT_RULES)
SUPPORTED_MODELS = ("gpt2", "llama", "bert")


def read_tokenizer_metadata(reader: GGUFReader | GGUFFile) -> dict[str, Any]:
    """Every `tokenizer.*` field of the file, and `general.name` (llama.cpp gives Phi-3's
    special tokens a strip rule by it), decoded to Python values."""
    if isinstance(reader, GGUFFile):
        return {k: v for k, v in reader.metadata.items() if _is_tokenizer_key(k)}
    return {name: field.contents() for name, field in reader.fields.items()
            if _is_tokenizer_key(name)}


def _is_tokenizer_key(key: str) -> bool:
    return key.startswith("tokenizer.") or key == "general.name"


def load_gguf_tokenizer(path_or_reader: str | Path | GGUFReader | GGUFFile) -> Tokenizer:
    """Build the tokenizer a GGUF file describes; refuse by name what we cannot build."""
    if isinstance(path_or_reader, (GGUFReader, GGUFFile)):
        reader, where = path_or_reader, "GGUF file"
    else:
        path = Path(path_or_reader)
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        reader, where = open_gguf_file(str(path)), str(path)
    return tokenizer_from_metadata(read_tokenizer_metadata(reader), where)


def tokenizer_from_metadata(meta: dict[str, Any], where: str = "GGUF file") -> Tokenizer:
    """The tokenizer for already-read `tokenizer.*` metadata (see `read_tokenizer_metadata`)."""
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise ValueError(f"{where}: tokenizer.ggml.model={model!r} is not supported; supported "
                         f"tokenizer models: {list(SUPPORTED_MODELS)}")
    tokens: list[str] = _required(meta, "tokenizer.ggml.tokens", where)
    token_types = meta.get("tokenizer.ggml.token_type")
    if token_types is not None and len(token_types) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.token_type has {len(token_types)} entries "
                         f"for {len(tokens)} tokens")
    if model == "bert":
        return _wordpiece_tokenizer(meta, tokens, token_types or [1] * len(tokens), where)
    if model == "llama":
        # llama.cpp's defaults for a SentencePiece vocabulary: BOS 1, EOS 2, unknown 0, and
        # BOS added.
        texts = token_texts(tokens)
        bos_id = _token_id(meta, "bos", len(tokens), where, default=1)
        eos_id = _token_id(meta, "eos", len(tokens), where, default=2)
        unk_id = _token_id(meta, "unknown", len(tokens), where, default=0)
        backend = spm_backend(meta, texts, token_attrs(meta, texts), unk_id, where)
        add_bos_default = True
    else:
        texts = tokens
        bos_id = _token_id(meta, "bos", len(tokens), where)
        eos_id = _token_id(meta, "eos", len(tokens), where)
        backend = _byte_level_backend(meta, tokens, token_types or [1] * len(tokens), where)
        add_bos_default = False
    backend.post_processor = bos_eos_post_processor(
        None if bos_id is None else (texts[bos_id], bos_id),
        None if eos_id is None else (texts[eos_id], eos_id),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_id=eos_id,
                     chat_template=meta.get("tokenizer.chat_template"))


def _wordpiece_tokenizer(meta: dict[str, Any], tokens: list[str], token_types: list[int],
                         where: str) -> Tokenizer:
    """A BERT WordPiece vocabulary (llama.cpp's ``bert`` model, as converted from an
    uncased BERT tokenizer): a word-initial piece is stored with a leading "▁", a
    continuation without it (``##`` in the original); control tokens ([CLS], [SEP], ...)
    as they are. Rebuilt as the original: lowercasing BERT normalizer, BERT
    pre-tokenizer, WordPiece, and [CLS] text [SEP] (pairs: [CLS] a [SEP] b [SEP])."""
    from tokenizers import normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, token_types)):
        if kind == _CONTROL:
            spelled = tok
        elif tok.startswith("\u2581"):
            spelled = tok[1:] or tok
        else:
            spelled = "##" + tok
        vocab.setdefault(spelled, i)
    unk_id = _token_id(meta, "unknown", len(tokens), where, default=100)
    cls_id = _token_id(meta, "bos", len(tokens), where, default=101)
    sep_id = _token_id(meta, "seperator", len(tokens), where,
                       default=_token_id(meta, "eos", len(tokens), where, default=102))
    if unk_id is None or cls_id is None or sep_id is None:
        raise ValueError(f"{where}: a bert vocabulary needs its [UNK], [CLS] and [SEP] ids")
    backend = BackendTokenizer(WordPiece(vocab, unk_token=tokens[unk_id],
                                         continuing_subword_prefix="##"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    cls, sep = tokens[cls_id], tokens[sep_id]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)])
    backend.add_special_tokens([AddedToken(tok, normalized=False, special=True)
                                for tok, kind in zip(tokens, token_types) if kind == _CONTROL])
    return Tokenizer(backend, bos_token_id=cls_id, eos_token_id=sep_id, chat_template=None)


def _byte_level_backend(meta: dict[str, Any], tokens: list[str], token_types: list[int],
                        where: str) -> BackendTokenizer:
    """The byte-level BPE pipeline (no post-processor) for a `gpt2` vocabulary."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SPLIT_RULES:
        raise ValueError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported; supported "
                         f"pre-tokenizers: {list(SUPPORTED_PRE)}")
    merges: list[str] = _required(meta, "tokenizer.ggml.merges", where)
    special_ids = {int(v) for k in ("bos", "eos", "unknown", "padding")
                   if (v := meta.get(f"tokenizer.ggml.{k}_token_id")) is not None}
    added_ids = special_ids | {i for i, kind in enumerate(token_types)
                               if kind in (_CONTROL, _USER_DEFINED)}
    pairs = []
    for n, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ValueError(f"{where}: tokenizer.ggml.merges[{n}]={merge!r} is not 'A B'")
        pairs.append((left, right))
    rule = SPLIT_RULES[pre]
    backend = BackendTokenizer(BPE(vocab=_vocabulary(tokens, added_ids), merges=pairs,
                                   fuse_unk=False, ignore_merges=rule.ignore_merges))
    backend.pre_tokenizer = rule.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tok, normalized=False, special=True)
                                for i, (tok, kind) in enumerate(zip(tokens, token_types))
                                if kind == _CONTROL or i in special_ids])
    backend.add_tokens([AddedToken(tok, normalized=False, special=False)
                        for i, (tok, kind) in enumerate(zip(tokens, token_types))
                        if kind == _USER_DEFINED and i not in special_ids])
    return backend


def _vocabulary(tokens: list[str], added_ids: set[int]) -> dict[str, int]:
    """Token spelling -> id for the BPE model.

    A token spelled in the byte alphabet keeps its spelling. An added token (control,
    user-defined, or a BOS/EOS/UNK/PAD id) written in plain text, as converters write
    DeepSeek's `<｜begin▁of▁sentence｜>`, keeps its text, so that finding it in a text gives
    its own id. Any other token is re-spelled byte by byte from its UTF-8 text. A spelling
    listed twice maps to its last id, as in llama.cpp and transformers.
    """
    spell = byte_level_alphabet()
    alphabet = set(spell.values())
    vocab = {}
    for i, token in enumerate(tokens):
        if not set(token) <= alphabet and i not in added_ids:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab[token] = i
    return vocab


def _required(meta: dict[str, Any], key: str, where: str) -> Any:
    value = meta.get(key)
    if not value:
        raise ValueError(f"{where}: metadata {key} is missing or empty; cannot build the "
                         f"tokenizer without it")
    return value


def _token_id(meta: dict[str, Any], name: str, n_tokens: int, where: str,
              default: int | None = None) -> int | None:
    """The id the file names for `name`, else `default` when it is inside the vocabulary."""
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return default if default is not None and default < n_tokens else None
    if not 0 <= int(value) < n_tokens:
        raise ValueError(f"{where}: tokenizer.ggml.{name}_token_id={value} is outside the "
                         f"vocabulary of {n_tokens} tokens")
    return int(value)
