"""Incremental detokenization: deltas concatenate to decode(all) and never split a character."""

from __future__ import annotations

import pytest

from vllmpy.tokenizer import IncrementalDetokenizer

STREAM_TEXTS = [
    "Hello 🎉 world 👨‍👩‍👧‍👦 and 🙂🙂 🫠🦩𓀀",
    "中文分词测试，你好世界。日本語のテキスト 한국어",
    "Café naïve — “quotes” ∑ x² ≤ ∞ \u00a0end",
    "<|im_start|>assistant\nSure 👍🏽<|im_end|>",
    "plain ascii text\n\twith tabs",
]


def _stream(tokenizer, prompt, ids, skip_special_tokens=True, step=1):
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_tokens(ids[i:i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("step", [1, 3])
def test_deltas_rebuild_decode(pair, skip_special_tokens, step):
    tok, _ = pair
    prompt = tok.encode("<|im_start|>user\nSay something 🎉<|im_end|>\n")
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        detok, deltas = _stream(tok, prompt, ids, skip_special_tokens, step)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected == detok.output_text, repr(text)
        assert not any("\ufffd" in d for d in deltas), deltas
        assert detok.num_output_tokens == len(ids)


def test_emoji_bytes_are_held_back(pair):
    tok, _ = pair
    ids = tok.encode("𓀀")
    assert len(ids) >= 3  # the character is cut into byte tokens
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_tokens([i]) for i in ids]
    assert deltas == [""] * (len(ids) - 1) + ["𓀀"]
    assert detok.flush() == ""


def test_flush_emits_incomplete_tail(pair):
    tok, _ = pair
    ids = tok.encode("ok 𓀀")[:-1]  # end in the middle of the emoji
    detok, deltas = _stream(tok, [], ids)
    assert deltas[-1].endswith("\ufffd")
    assert "".join(deltas) == tok.decode(ids)


def test_window_stays_small(smollm):
    tok, _ = smollm
    ids = tok.encode("word " * 400 + "🎉")
    detok = IncrementalDetokenizer(tok, tok.encode("prompt " * 100))
    widest = 0
    for i in ids:
        detok.add_tokens([i])
        widest = max(widest, len(detok._ids))
    assert widest <= 6
    assert detok.output_text == tok.decode(ids)
