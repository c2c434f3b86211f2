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
        raise ValueError(f"{where}: {key}={text!r} is not in the vocabulary of tokenizer.json")
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
