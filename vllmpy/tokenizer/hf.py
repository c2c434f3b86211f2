"""Loading a Hugging Face tokenizer directory: tokenizer.json + tokenizer_config.json.

What is read from tokenizer_config.json (or the file `tokenizer_config_path` names, which
replaces it -- this backs `--tokenizer-config`):

- `bos_token`, `eos_token`: a string or an `{"content": ...}` object, looked up in the vocabulary;
- `add_bos_token`, `add_eos_token`: used only when tokenizer.json has no post-processor. A
  post-processor in tokenizer.json decides alone whether BOS/EOS are added, as in transformers
  5, which drops these two flags whenever a tokenizer.json exists;
- `added_tokens_decoder`: added tokens that tokenizer.json lacks are added;
- `chat_template`: a string, or a list of `{"name", "template"}` of which "default" is used. A
  `chat_template.jinja` file next to tokenizer.json takes precedence, as in transformers,
  except over a template in a config file named by `tokenizer_config_path`.

`apply_tokenizer_config` applies such a file to a tokenizer built from GGUF metadata instead
(`--tokenizer-config` on a `.gguf`): what it takes and what it refuses is said there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from vllmpy.tokenizer.tokenizer import Tokenizer, bos_eos_post_processor


def load_hf_tokenizer(model_dir: str | Path, tokenizer_config_path: str | Path | None = None
                      ) -> Tokenizer:
    model_dir = Path(model_dir)
    tokenizer_json = model_dir / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ValueError(f"no tokenizer.json at {tokenizer_json}; vllmpy loads tokenizers from "
                         f"tokenizer.json (or from a .gguf file's metadata)")
    try:
        backend = BackendTokenizer.from_file(str(tokenizer_json))
    except Exception as e:  # the tokenizers library raises plain Exception on bad files
        raise ValueError(f"cannot read {tokenizer_json}: {e}") from None
    # A tokenizer.json may carry the truncation and padding its exporter used (sentence-
    # transformers' pad every input to 128): transformers' fast tokenizers turn them off
    # and truncate or pad only when asked, and so does the engine.
    backend.no_truncation()
    backend.no_padding()

    if tokenizer_config_path is not None:
        config_path = Path(tokenizer_config_path)
        if not config_path.is_file():
            raise ValueError(f"tokenizer config not found: {config_path}")
    else:
        config_path = model_dir / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}

    _add_missing_tokens(backend, config.get("added_tokens_decoder") or {}, config_path)
    bos = _special_token(backend, config, "bos_token", config_path)
    eos = _special_token(backend, config, "eos_token", config_path)

    if backend.post_processor is None:
        backend.post_processor = bos_eos_post_processor(
            bos, eos,
            add_bos=bool(config.get("add_bos_token", False)),
            add_eos=bool(config.get("add_eos_token", False)),
        )
    return Tokenizer(backend, bos_token_id=bos[1] if bos else None,
                     eos_token_id=eos[1] if eos else None,
                     chat_template=_chat_template(model_dir, config, config_path,
                                                  explicit_config=tokenizer_config_path is not None))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read tokenizer config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"tokenizer config {path} is not a JSON object")
    return data


def _token_content(value: Any, key: str, where: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: {key} must be a string or an object with 'content', got {value!r}")


def _special_token(backend: BackendTokenizer, config: dict[str, Any], key: str,
                   where: Path) -> tuple[str, int] | None:
    """`(text, id)` of the token the config names under `key`, or None."""
    text = _token_content(config.get(key), key, where)
    if text is None:
        return None
    token_id = backend.token_to_id(text)
    if token_id is None:
        raise ValueError(f"{where}: {key}={text!r} is not in the vocabulary")
    return text, token_id


def _add_missing_tokens(backend: BackendTokenizer, decoder: dict[str, Any], where: Path) -> None:
    """Add `added_tokens_decoder` entries that tokenizer.json does not already hold."""
    known = backend.get_added_tokens_decoder()
    for key, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        token_id = int(key)
        if token_id in known:
            continue
        content = _token_content(entry, f"added_tokens_decoder[{key}]", where)
        if content is None:
            continue
        token = AddedToken(content, single_word=bool(entry.get("single_word", False)),
                           lstrip=bool(entry.get("lstrip", False)),
                           rstrip=bool(entry.get("rstrip", False)),
                           normalized=bool(entry.get("normalized", False)),
                           special=bool(entry.get("special", False)))
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        if backend.token_to_id(content) != token_id:
            raise ValueError(f"{where}: added token {content!r} is declared with id {token_id} "
                             f"but tokenizer.json gives it id {backend.token_to_id(content)}")


def _chat_template(model_dir: Path, config: dict[str, Any], where: Path,
                   explicit_config: bool) -> str | None:
    # A config file the user names wins; otherwise chat_template.jinja beats the config's entry.
    jinja_file = model_dir / "chat_template.jinja"
    if not (explicit_config and config.get("chat_template")) and jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return _config_template(config, where)


def _config_template(config: dict[str, Any], where: Path) -> str | None:
    """The config's ``chat_template``: a string, or the one named "default" of a list."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{where}: chat_template lists templates {sorted(map(str, named))} "
                         f"but none named 'default'")
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates")


# tokenizer_config.json keys that say how a tokenizer is built (its own vocabulary files, how
# text is split, cleaned or cased): a tokenizer built from a GGUF file's metadata cannot
# take them, so a set value (anything but null or false) is refused.
GGUF_REFUSED_KEYS = ("tokenizer_file", "vocab_file", "merges_file", "add_prefix_space",
                     "do_lower_case", "clean_up_tokenization_spaces", "split_special_tokens")


def apply_tokenizer_config(tokenizer: Tokenizer, config_path: str | Path) -> Tokenizer:
    """``tokenizer`` (built from a GGUF file's metadata) with a tokenizer_config.json applied,
    as ``--tokenizer-config`` asks:

    - ``chat_template`` replaces the GGUF's template (a string, or "default" of a list);
    - ``bos_token`` / ``eos_token`` (null or absent: the GGUF's) name tokens of the GGUF
      vocabulary: the template's ``bos_token`` / ``eos_token`` and the tokens encode adds;
    - ``add_bos_token`` / ``add_eos_token`` replace the GGUF's own flags;
    - ``added_tokens_decoder`` must agree with the GGUF vocabulary (id and text); an entry
      the vocabulary has not marked as added is added.

    A set value of a ``GGUF_REFUSED_KEYS`` key is refused by name. Other keys
    (``tokenizer_class``, ``model_max_length``, ``pad_token``, ...) change nothing here,
    as for a model directory. The engine's stop ids stay the model's."""
    path = Path(config_path)
    if not path.is_file():
        raise ValueError(f"tokenizer config not found: {path}")
    config = _read_json(path)
    for key in GGUF_REFUSED_KEYS:
        if config.get(key) not in (None, False):
            raise ValueError(f"{path}: {key}={config[key]!r} cannot apply to a tokenizer built "
                             f"from a GGUF file's metadata, whose vocabulary, splitting and "
                             f"decoding come from the file; remove {key} or set it to null")
    backend = tokenizer.backend
    decoder = config.get("added_tokens_decoder") or {}
    _check_known_tokens(backend, decoder, path)
    _add_missing_tokens(backend, decoder, path)
    bos = _special_token(backend, config, "bos_token", path) or _own(tokenizer, "bos")
    eos = _special_token(backend, config, "eos_token", path) or _own(tokenizer, "eos")
    add_bos, add_eos = _added_specials(tokenizer)
    backend.post_processor = bos_eos_post_processor(
        bos, eos, add_bos=bool(config.get("add_bos_token", add_bos)),
        add_eos=bool(config.get("add_eos_token", add_eos)))
    template = _config_template(config, path)
    return Tokenizer(backend, bos_token_id=bos[1] if bos else None,
                     eos_token_id=eos[1] if eos else None,
                     chat_template=tokenizer.chat_template if template is None else template)


def _own(tokenizer: Tokenizer, kind: str) -> tuple[str, int] | None:
    """`(text, id)` of the tokenizer's own BOS or EOS token, or None."""
    text, token_id = getattr(tokenizer, f"{kind}_token"), getattr(tokenizer, f"{kind}_token_id")
    return None if text is None or token_id is None else (text, token_id)


def _added_specials(tokenizer: Tokenizer) -> tuple[bool, bool]:
    """(adds BOS, adds EOS): what ``encode(text, add_special_tokens=True)`` puts around a
    text, read off an empty one (a lone id that is both BOS and EOS counts as BOS)."""
    ids = tokenizer.backend.encode("", add_special_tokens=True).ids
    add_bos = bool(ids) and ids[0] == tokenizer.bos_token_id
    add_eos = len(ids) == 1 + add_bos and ids[-1] == tokenizer.eos_token_id
    return add_bos, add_eos


def _check_known_tokens(backend: BackendTokenizer, decoder: dict[str, Any], where: Path) -> None:
    """An ``added_tokens_decoder`` entry for an id the vocabulary has marked as added must
    spell the same token: a config written for another vocabulary is refused."""
    known = backend.get_added_tokens_decoder()
    for key, entry in decoder.items():
        content = _token_content(entry, f"added_tokens_decoder[{key}]", where)
        token = known.get(int(key))
        if token is not None and content is not None and token.content != content:
            raise ValueError(f"{where}: added_tokens_decoder gives id {key} the token "
                             f"{content!r}, but the GGUF vocabulary has {token.content!r} "
                             f"there: this config belongs to another vocabulary")
