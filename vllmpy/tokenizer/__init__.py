"""Tokenizers (from tokenizer.json or GGUF metadata), chat templates and streaming detokenization."""

from __future__ import annotations

from pathlib import Path

from vllmpy.tokenizer.chat_template import ChatTemplateError, render_chat_template
from vllmpy.tokenizer.detokenizer import IncrementalDetokenizer
from vllmpy.tokenizer.gguf_tokenizer import load_gguf_tokenizer
from vllmpy.tokenizer.hf import apply_tokenizer_config, load_hf_tokenizer
from vllmpy.tokenizer.tokenizer import Tokenizer


def load_tokenizer(path: str | Path, tokenizer_config_path: str | Path | None = None) -> Tokenizer:
    """A tokenizer from a Hugging Face directory or a `.gguf` file."""
    path = Path(path)
    if path.is_dir():
        return load_hf_tokenizer(path, tokenizer_config_path)
    if path.is_file() and path.suffix == ".gguf":
        tokenizer = load_gguf_tokenizer(path)
        if tokenizer_config_path is not None:  # what of it applies to a built tokenizer
            tokenizer = apply_tokenizer_config(tokenizer, tokenizer_config_path)
        return tokenizer
    raise ValueError(f"cannot load a tokenizer from {path}: expected a directory with "
                     "tokenizer.json or a .gguf file")


__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_gguf_tokenizer",
    "load_hf_tokenizer",
    "load_tokenizer",
    "render_chat_template",
]
