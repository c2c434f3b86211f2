"""Fetching a model from the Hugging Face Hub into its local cache.

Only the files the engine reads are fetched: configs, tokenizer files and safetensors
weights. A snapshot already in the cache is reused (``HF_HUB_OFFLINE=1`` works when it is).
"""

from __future__ import annotations

import os
import re

import huggingface_hub
from huggingface_hub import errors as hub_errors

# Files the engine reads from a repo: config.json, generation_config.json,
# tokenizer.json, tokenizer_config.json, special_tokens_map.json, the safetensors
# index and shards, and the tokenizer files some repos still ship in other forms.
ALLOW_PATTERNS: list[str] = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "merges.txt",
    "vocab.txt",
]

# "org/name": both parts start with a letter or digit and hold letters, digits, "-",
# "_" and "."; the form the Hub gives repo ids.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")

# What huggingface_hub raises when it cannot reach the Hub, is offline without a cached
# snapshot, or is told the repo or revision does not exist. ``HTTPError`` is the base
# error of the HTTP client huggingface_hub is built on (connection errors, timeouts).
_HUB_ERRORS: tuple[type[BaseException], ...] = (
    hub_errors.HfHubHTTPError,
    hub_errors.LocalEntryNotFoundError,
    hub_errors.OfflineModeIsEnabled,
    hub_errors.HFValidationError,
    hub_errors.HTTPError,
    ConnectionError,
    TimeoutError,
)


class ModelNotFoundError(ValueError):
    """A model given as a Hub repo id could not be fetched."""


def looks_like_repo_id(s: str) -> bool:
    """True when ``s`` has the ``org/name`` form of a Hub repo id and is not an existing path.

    A missing ``x/y.gguf`` is taken for a mistyped local file, not a repo id.
    """
    if os.path.exists(s) or s.lower().endswith(".gguf"):
        return False
    return _REPO_ID.fullmatch(s) is not None and ".." not in s


def download_model(
    repo_id: str, revision: str | None = None, download_dir: str | None = None
) -> str:
    """Fetch ``repo_id`` at ``revision`` and return the local snapshot directory.

    Uses huggingface_hub's cache (or ``download_dir`` as the cache directory) and its
    progress bars. Raises ModelNotFoundError naming the repo id and revision when the Hub
    cannot be reached, offline mode is on without a cached copy, or the repo or revision
    does not exist.
    """
    try:
        path = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=ALLOW_PATTERNS,
        )
    except _HUB_ERRORS as e:
        where = f"revision {revision!r}" if revision else "the default revision"
        raise ModelNotFoundError(
            f"could not fetch model {repo_id!r} ({where}) from the Hugging Face Hub: the hub "
            "could not be reached, or the repo or revision does not exist "
            f"({type(e).__name__}: {_first_line(e)}). A local model directory or a .gguf "
            "file path works too."
        ) from e
    return str(path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no details"
