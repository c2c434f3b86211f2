"""The xgrammar backend: constraint -> grammar, tokenizer -> TokenizerInfo, compilation.

xgrammar (and the transformers package it imports) loads in about two seconds, so it is
imported on first use only: a process that never sees a structured request never pays.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllmpy.structured_output.params import StructuredOutputsParams
from vllmpy.structured_output.schema_check import check_json_schema

if TYPE_CHECKING:
    import xgrammar

    from vllmpy.tokenizer.tokenizer import Tokenizer

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; that is not for users.
_LOCATION = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")
_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice list",
         "grammar": "grammar", "json_object": "JSON grammar"}


def xgr() -> Any:
    """The xgrammar module, imported on first use."""
    import xgrammar

    return xgrammar


def error_text(exc: BaseException) -> str:
    """xgrammar's message without its source location, on one line."""
    text = _CHECK_FAILED.sub("", _LOCATION.sub("", str(exc)).strip())
    return " ".join(text.split())


def choice_ebnf(choices: Iterable[str]) -> str:
    """A grammar whose strings are exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """Parse the constraint into an xgrammar ``Grammar`` (no tokenizer needed): the check
    the frontend runs before a request is accepted. Raises ValueError naming the problem."""
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            check_json_schema(schema)
            return xgr().Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=not params.disable_any_whitespace,
                strict_mode=True)
        if kind == "json_object":
            return xgr().Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr().Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr().Grammar.from_ebnf(choice_ebnf(params.choice or ()))
        return xgr().Grammar.from_ebnf(params.grammar)
    except RuntimeError as e:
        raise ValueError(f"invalid {_WHAT[kind]}: {error_text(e)}") from None


def compile_grammar(compiler: xgrammar.GrammarCompiler,
                    params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
    """Compile the constraint against the tokenizer ``compiler`` was built for."""
    kind = params.kind
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    return compiler.compile_grammar(build_grammar(params))


# ---- the tokenizer as xgrammar sees it -------------------------------------------------


def _decoder_types(tokenizer: Tokenizer) -> set[str]:
    """Every decoder type in the tokenizer's decoder, nested sequences included."""
    decoder = tokenizer.backend.decoder
    if decoder is None:
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(decoder.__getstate__()))
    return found


def vocab_type(tokenizer: Tokenizer) -> xgrammar.VocabType:
    """How the vocabulary spells bytes: byte-level BPE ("Ġ" for a space), byte fallback
    ("<0x0A>" pieces, "▁" for a space) or raw text. Read from the tokenizer's decoder."""
    types = _decoder_types(tokenizer)
    if "ByteFallback" in types:
        return xgr().VocabType.BYTE_FALLBACK
    if "ByteLevel" in types:
        return xgr().VocabType.BYTE_LEVEL
    if "Metaspace" in types or "Replace" in types:
        raise ValueError(f"structured output does not support this tokenizer: its decoder "
                         f"({', '.join(sorted(types))}) rewrites pieces without byte "
                         "fallback or byte-level spelling")
    return xgr().VocabType.RAW


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int,
                   stop_token_ids: Iterable[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of ``tokenizer`` for a model whose logits are ``vocab_size`` wide
    (at least the tokenizer's size; ids past the tokenizer's are never allowed)."""
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"the model's vocabulary ({vocab_size}) is smaller than the "
                         f"tokenizer's ({tokenizer.vocab_size})")
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        encoded[token_id] = token
    kind = vocab_type(tokenizer)
    stops = sorted(set(stop_token_ids) | ({tokenizer.eos_token_id}
                                          if tokenizer.eos_token_id is not None else set()))
    if not stops:
        raise ValueError("structured output needs an end-of-sequence token id, and the model "
                         "defines none")
    return xgr().TokenizerInfo(encoded, kind, vocab_size=vocab_size, stop_token_ids=stops,
                               add_prefix_space=_adds_prefix_space(tokenizer, kind))


def _adds_prefix_space(tokenizer: Tokenizer, kind: xgrammar.VocabType) -> bool:
    """Whether encoding "a" gives a token spelled with a leading space marker."""
    ids = tokenizer.encode("a", add_special_tokens=False)
    if not ids:
        return False
    first = tokenizer.convert_ids_to_tokens(ids[:1])[0]
    marker = {xgr().VocabType.BYTE_FALLBACK: "\u2581", xgr().VocabType.BYTE_LEVEL: "\u0120"}
    return kind in marker and first.startswith(marker[kind])


@functools.lru_cache(maxsize=256)
def _validated(key: tuple[str, str, bool]) -> None:
    """Validation results by key; a failure raises and is not cached."""
    kind, spec, no_space = key
    value: Any = json.loads(spec) if kind == "choice" else spec
    if kind == "json_object":
        value = True
    build_grammar(StructuredOutputsParams(**{kind: value}, disable_any_whitespace=no_space))


def validate(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem when ``params`` cannot be compiled."""
    _validated(params.key())
