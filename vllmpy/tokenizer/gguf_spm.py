"""A SentencePiece tokenizer (`tokenizer.ggml.model` = "llama") rebuilt from GGUF metadata.

Gemma, Phi-3 and Llama-2-style files store a SentencePiece vocabulary: each token's text (a
space spelled "▁"), a score, a type, and 256 byte tokens `<0x00>` ... `<0xFF>`. We build the
`tokenizers` pipeline that gives llama.cpp's ids (`llm_tokenizer_spm` in llama-vocab.cpp):

- Special tokens are cut out of the text first (see `token_attrs` for which, and the strips).
- Each remaining piece gets a leading space when `tokenizer.ggml.add_space_prefix` says so
  (default true): llama.cpp adds it at the start of the text and after every special token,
  which is every piece here. Then spaces become "▁".
- A piece is split into characters, and the adjacent pair whose concatenation is a token with
  the highest score is merged, again and again; what is left and is not a token comes out as
  its UTF-8 bytes' `<0xXX>` tokens. That is BPE with one merge per way of cutting a token in
  two, ranked by the token's score (`score_merges`), and byte fallback.
- Decoding: "▁" becomes a space, byte tokens become their bytes, and (with the space prefix)
  one leading space of the text goes.

Where this differs from llama.cpp (never on llama.cpp's golden vectors; the strip and the decoding
of a leading special token show in tests/tokenizer/test_llama_cpp_vocab.py as strict xfails):
- Merge order among equal scores: llama.cpp merges the leftmost pair; here one of them is ranked
  first (lower token id, then shorter left part). Ties are tokens of one score (byte and control
  tokens all have 0 in Llama's file) and one token cut two ways at two places of the text.
- A character that is not a token itself but begins a longer token (no such token in the files
  tested) can merge in llama.cpp; here it falls back to bytes.
- Special tokens that overlap in the text: llama.cpp cuts out the longest token everywhere first,
  `tokenizers` takes the leftmost match (then the longest).
- Phi-3's strip after a special token: llama.cpp strips ASCII whitespace, `tokenizers` every
  Unicode whitespace character.
- Decoding a user-defined or control token: llama.cpp writes its text as it is, we turn its "▁"
  into spaces; an unused token (type 5) decodes to nothing in llama.cpp and to its text here;
  the leading space goes from the first token in llama.cpp and from the text here, so
  `decode([BOS, "▁Hi"], skip_special_tokens=True)` is "Hi" here (as in transformers) and " Hi"
  in llama.cpp.
"""

from __future__ import annotations

import enum
from typing import Any

from tokenizers import AddedToken, decoders, normalizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

SPACE = "\u2581"  # "▁"


class Attr(enum.IntFlag):
    """llama.cpp's token attributes (`llama_token_attr`)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    RSTRIP = 1 << 8


# GGUF token type (gguf.TokenType) -> attribute; any other type is UNDEFINED.
_TYPE_ATTR = {1: Attr.NORMAL, 2: Attr.UNKNOWN, 3: Attr.CONTROL, 4: Attr.USER_DEFINED,
              5: Attr.UNUSED, 6: Attr.BYTE}

# Texts llama.cpp makes control tokens whatever their type: the end-of-turn / end-of-generation
# tokens, always; a fill-in-the-middle kind's spelling only when the file names no id for that
# kind (llama.cpp takes whichever spelling its hash map yields first, we the lowest id).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# gpt-oss's tokens that llama.cpp always renders (user-defined).
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def token_texts(tokens: list[str]) -> list[str]:
    """The token texts as llama.cpp keeps them: an empty one becomes `[EMPTY_<id>]`."""
    return [text or f"[EMPTY_{i}]" for i, text in enumerate(tokens)]


def token_attrs(meta: dict[str, Any], texts: list[str]) -> list[Attr]:
    """Each token's attributes as llama.cpp derives them (llama_vocab::impl::load).

    From the token type, then: the end-of-generation texts (`_EOG_TEXTS`) and fill-in-the-middle
    texts become control tokens; with both `<|return|>` and `<|call|>` (or `<|calls|>` and
    `<|flush|>`) `<|end|>` is user-defined; gpt-oss's `<|channel|>`-style tokens are
    user-defined; and when the file's `general.name` contains "phi-3" or "phi3" every special
    token strips the whitespace after it (RSTRIP) except `<unk>`, `<s>` and `<|endoftext|>`.
    A text listed twice counts at its last id, as llama.cpp's text -> id map has it.
    """
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(texts)
    attrs = [_TYPE_ATTR.get(int(t), Attr.UNDEFINED) for t in types]
    ids = {text: i for i, text in enumerate(texts)}
    promoted = {ids[t] for t in _EOG_TEXTS if t in ids}
    for kind, spellings in _FIM_TEXTS.items():
        found = sorted(ids[t] for t in spellings if t in ids)
        if meta.get(f"tokenizer.ggml.{kind}_token_id") is None and found:
            promoted.add(found[0])
    for i in promoted:
        attrs[i] |= Attr.CONTROL
    if "<|end|>" in ids and (({"<|return|>", "<|call|>"} <= ids.keys())
                             or ({"<|calls|>", "<|flush|>"} <= ids.keys())):
        attrs[ids["<|end|>"]] = Attr.USER_DEFINED
    for text in _ALWAYS_RENDERED:
        if text in ids:
            attrs[ids[text]] = Attr.USER_DEFINED
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:
        for i, attr in enumerate(attrs):
            if attr & (Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN):
                attrs[i] |= Attr.RSTRIP
        for text, strip in (("</s>", True), ("<unk>", False), ("<s>", False),
                            ("<|endoftext|>", False)):
            if text in ids:
                attrs[ids[text]] = (attrs[ids[text]] | Attr.RSTRIP if strip
                                    else attrs[ids[text]] & ~Attr.RSTRIP)
    return attrs


def score_merges(texts: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges that replay llama.cpp's SentencePiece merging.

    llama.cpp merges the adjacent pair whose concatenation is a token of the highest score. So
    every way of cutting a token in two parts that are tokens themselves is a merge, ranked by
    the whole token's score, highest first (ties: lower token id, then shorter left part).
    """
    ids = {text: i for i, text in enumerate(texts)}
    ranked = []
    for text, i in ids.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in ranked]


def spm_backend(meta: dict[str, Any], texts: list[str], attrs: list[Attr],
                unk_id: int | None, where: str) -> BackendTokenizer:
    """The `tokenizers` pipeline for a SentencePiece vocabulary (no post-processor)."""
    scores = meta.get("tokenizer.ggml.scores")
    if not scores or len(scores) < len(texts):
        raise ValueError(f"{where}: tokenizer.ggml.scores is missing or shorter than the "
                         f"{len(texts)} tokens; a SentencePiece vocabulary (tokenizer.ggml."
                         f"model='llama') is merged by these scores")
    vocab = {text: i for i, text in enumerate(texts)}
    model = BPE(vocab=vocab, merges=score_merges(texts, [float(s) for s in scores]),
                unk_token=None if unk_id is None else texts[unk_id],
                byte_fallback=True, fuse_unk=False)
    backend = BackendTokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend(SPACE)] if prefix else []), normalizers.Replace(" ", SPACE)])
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
         *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    # The tokens llama.cpp cuts out of the text first: control and unknown ones only when it
    # parses special tokens (`special` here: `encode_special_tokens` turns them off),
    # user-defined ones always.
    special = Attr.CONTROL | Attr.UNKNOWN
    backend.add_special_tokens([
        AddedToken(texts[i], special=True, normalized=False, rstrip=bool(a & Attr.RSTRIP))
        for i, a in enumerate(attrs) if a & special])
    backend.add_tokens([
        AddedToken(texts[i], special=False, normalized=False, rstrip=bool(a & Attr.RSTRIP))
        for i, a in enumerate(attrs) if a & Attr.USER_DEFINED and not a & special])
    return backend
