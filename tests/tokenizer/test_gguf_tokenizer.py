"""GGUF tokenizers against transformers' conversion of the same files, plus refusals."""

from __future__ import annotations

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import normalizers, pre_tokenizers

from vllmpy.tokenizer import load_gguf_tokenizer
from vllmpy.tokenizer.gguf_tokenizer import SUPPORTED_PRE, tokenizer_from_metadata


def test_texts_are_varied(texts):
    assert len(texts) >= 40


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, texts, add_special_tokens):
    ours, ref = pair
    for text in texts:
        expected = ref.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair, texts, skip_special_tokens):
    ours, ref = pair
    for text in texts:
        ids = ref.encode(text, add_special_tokens=False)
        expected = ref.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, repr(text)
    # Byte tokens that cut a character in half decode the same way too.
    split_emoji = ours.encode("🎉")[:1]
    assert ours.decode(split_emoji) == ref.decode(split_emoji)


def test_special_tokens_and_ids(pair):
    ours, ref = pair
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.eos_token == ref.eos_token
    assert ours.chat_template == ref.chat_template
    ids = ours.encode("<|im_start|>user")
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    # Every id transformers treats as special is special here too (dropped by decode).
    assert set(ref.all_special_ids) <= set(ours.all_special_ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([ours.vocab_size])


def test_checkpoint_facts(smollm, qwen):
    smol, qwen = smollm[0], qwen[0]
    assert (smol.bos_token_id, smol.eos_token_id) == (1, 2)
    assert (qwen.bos_token_id, qwen.eos_token_id) == (151643, 151645)
    # Neither file asks for BOS: encode adds nothing.
    assert smol.encode("hi") == smol.encode("hi", add_special_tokens=False)
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)
    # <tool_call> is user-defined in the Qwen file: one token, kept on decode.
    tool_call = qwen.encode("<tool_call>")
    assert tool_call == [151657] and qwen.decode(tool_call) == "<tool_call>"
    assert qwen.decode(qwen.encode("<|im_end|>")) == ""


def test_max_token_bytes(pair):
    ours, _ = pair
    longest = max(len(ours.decode([i], skip_special_tokens=False).encode("utf-8"))
                  for i in range(ours.vocab_size)
                  if "\ufffd" not in ours.decode([i], skip_special_tokens=False))
    assert ours.max_token_bytes >= longest
    # Only partial-character tokens could be longer when decoded alone; none is that long.
    assert ours.max_token_bytes == longest


def test_smollm_digit_split_divergence(smollm, texts):
    """SmolLM2's own tokenizer.json splits digits off (Digits(individual_digits=True) before
    the GPT-2 ByteLevel split), and so does llama.cpp's `smollm` rule; transformers' GGUF
    conversion uses the plain GPT-2 split. We match transformers. The ids differ where
    - a run of 2+ whitespace characters is followed by a numeric character: the original keeps
      the run whole ("ĠĠ"), transformers splits off its last character;
    - a space is followed by a non-ASCII numeric character (١ ² ½ Ⅳ): the original splits the
      space off, transformers may merge it with the character's first byte ("ĠÙ").
    ASCII digits have no merges at all, so everything else agrees."""
    ours, ref = smollm
    original = BackendTokenizer.from_str(ours.backend.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    differing = [t for t in texts if original.encode(t).ids != ours.encode(t)]
    assert differing == ["x  1\n\n2\t\t3", "numerals: ١٢٣ ²³ ½ Ⅳ １２"]
    assert original.encode("x  1").tokens == ["x", "ĠĠ", "1"]
    assert ours.convert_ids_to_tokens(ours.encode("x  1")) == ["x", "Ġ", "Ġ", "1"]
    assert ours.encode("x  1") == ref.encode("x  1")
    assert original.encode(" ²").tokens == ["Ġ", "Â²"]
    assert ours.convert_ids_to_tokens(ours.encode(" ²")) == ["ĠÂ", "²"]
    assert ours.encode(" ²") == ref.encode(" ²")
    # Digits are split one by one either way.
    assert original.encode("12345").ids == ours.encode("12345")


def test_qwen2_nfc_divergence(qwen, texts):
    """Qwen2's own tokenizer.json NFC-normalizes text first; transformers' GGUF conversion (and
    llama.cpp) do not. We match transformers: only non-NFC text differs."""
    ours, ref = qwen
    original = BackendTokenizer.from_str(ours.backend.to_str())
    original.normalizer = normalizers.NFC()
    differing = [t for t in texts if original.encode(t).ids != ours.encode(t)]
    assert differing == ["e\u0301t\u0301e\u0301 (decomposed accents)"]
    assert ours.encode("e\u0301") == ref.encode("e\u0301") != original.encode("e\u0301").ids


# ---- refusals ----

def _tiny_gguf(tmp_path, model: str, pre: str | None):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab", "<s>"])
    writer.add_token_types([1, 1, 1, 3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(3)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_builds_and_adds_bos(tmp_path):
    tok = load_gguf_tokenizer(_tiny_gguf(tmp_path, "gpt2", "qwen2"))
    assert tok.encode("ab") == [3, 2]
    assert tok.encode("ab", add_special_tokens=False) == [2]
    assert tok.decode([3, 2, 0]) == "aba"


def test_unsupported_pre_is_refused(tmp_path):
    path = _tiny_gguf(tmp_path, "gpt2", "deepseek-coder")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='deepseek-coder'") as err:
        load_gguf_tokenizer(path)
    for name in SUPPORTED_PRE:
        assert name in str(err.value)


def test_unsupported_model_is_refused(tmp_path):
    path = _tiny_gguf(tmp_path, "t5", None)
    with pytest.raises(ValueError, match="tokenizer.ggml.model='t5'.*'gpt2', 'llama'"):
        load_gguf_tokenizer(path)
    with pytest.raises(ValueError, match="tokenizer.ggml.model=None"):
        tokenizer_from_metadata({})


def test_spm_without_scores_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.ggml.scores is missing"):
        load_gguf_tokenizer(_tiny_gguf(tmp_path, "llama", None))


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_gguf_tokenizer(tmp_path / "nope.gguf")
