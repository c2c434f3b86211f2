"""tokenizer.json + tokenizer_config.json directories, checked against transformers."""

from __future__ import annotations

import json
import warnings

import pytest

from vllmpy.tokenizer import load_hf_tokenizer, load_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer_json(smollm) -> str:
    return smollm[0].backend.to_str()


def _write_dir(path, tokenizer_json, config):
    path.mkdir(exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def _transformers(path):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(path))


def test_matches_transformers_with_bos(tmp_path, tokenizer_json, texts):
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
              "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
              "add_bos_token": True, "chat_template": TEMPLATE}
    model_dir = _write_dir(tmp_path / "m", tokenizer_json, config)
    ours, ref = load_hf_tokenizer(model_dir), _transformers(model_dir)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    # tokenizer.json's post-processor adds nothing, and it wins over add_bos_token.
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False) == ref.encode("hi")
    for text in texts:
        for add in (True, False):
            assert ours.encode(text, add) == ref.encode(text, add_special_tokens=add), repr(text)
        ids = ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_config_flags_apply_without_file_post_processor(tmp_path, tokenizer_json):
    data = json.loads(tokenizer_json)
    data["post_processor"] = None
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "add_bos_token": True, "add_eos_token": True}
    tok = load_hf_tokenizer(_write_dir(tmp_path / "m", json.dumps(data), config))
    bare = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi") == [1, *bare, 2]
    data["post_processor"] = json.loads(tok.backend.to_str())["post_processor"]
    del config["add_eos_token"]
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(config))
    # With a post-processor in tokenizer.json, that one decides (here: BOS and EOS).
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps(data))
    assert load_hf_tokenizer(tmp_path / "m").encode("hi") == [1, *bare, 2]


def test_file_post_processor_kept_without_flags(tmp_path, tokenizer_json):
    tok = load_hf_tokenizer(_write_dir(tmp_path / "m", tokenizer_json, {"eos_token": "<|im_end|>"}))
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.bos_token_id is None and tok.eos_token_id == 2
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_json_names_the_path(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "tokenizer.json")):
        load_hf_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path / "missing")


def test_tokenizer_config_path_overrides(tmp_path, tokenizer_json):
    model_dir = _write_dir(tmp_path / "m", tokenizer_json,
                           {"bos_token": "<|im_start|>", "add_bos_token": True,
                            "chat_template": "from the directory"})
    (model_dir / "chat_template.jinja").write_text("from the jinja file", encoding="utf-8")
    assert load_tokenizer(model_dir).chat_template == "from the jinja file"

    override = tmp_path / "override.json"
    override.write_text(json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False,
                                    "chat_template": [{"name": "tool_use", "template": "t"},
                                                      {"name": "default", "template": TEMPLATE}]}))
    tok = load_hf_tokenizer(model_dir, tokenizer_config_path=override)
    assert tok.chat_template == TEMPLATE
    assert tok.eos_token_id == 0 and tok.bos_token_id is None
    with pytest.raises(ValueError, match="tokenizer config not found"):
        load_hf_tokenizer(model_dir, tokenizer_config_path=tmp_path / "nope.json")


def test_config_refusals(tmp_path, tokenizer_json):
    bad_bos = _write_dir(tmp_path / "a", tokenizer_json, {"bos_token": "<nope>"})
    with pytest.raises(ValueError, match="bos_token='<nope>' is not in the vocabulary"):
        load_hf_tokenizer(bad_bos)
    no_post = dict(json.loads(tokenizer_json), post_processor=None)
    no_bos = _write_dir(tmp_path / "b", json.dumps(no_post), {"add_bos_token": True})
    with pytest.raises(ValueError, match="no BOS token"):
        load_hf_tokenizer(no_bos)
    no_default = _write_dir(tmp_path / "c", tokenizer_json,
                            {"chat_template": [{"name": "rag", "template": "x"}]})
    with pytest.raises(ValueError, match="none named 'default'"):
        load_hf_tokenizer(no_default)
    broken = _write_dir(tmp_path / "d", "{not json", None)
    with pytest.raises(ValueError, match="cannot read"):
        load_hf_tokenizer(broken)


def test_added_tokens_from_config(tmp_path, tokenizer_json, smollm):
    vocab_size = smollm[0].vocab_size
    config = {"added_tokens_decoder": {
        "1": {"content": "<|im_start|>", "special": True},
        str(vocab_size): {"content": "<think>", "special": False},
    }}
    tok = load_hf_tokenizer(_write_dir(tmp_path / "m", tokenizer_json, config))
    assert tok.vocab_size == vocab_size + 1
    ids = tok.encode("a<think>b")
    assert vocab_size in ids and tok.decode(ids) == "a<think>b"
