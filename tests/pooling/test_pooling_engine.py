"""The pooling path through the engine, on the CPU: a decoder served with ``--runner
pooling`` (last-token embeddings, as Qwen3-Embedding) against transformers' hidden states
on the same random weights; the pooling types, matryoshka dimensions, truncation and the
refusals; every KV block back in the pool after a run."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from server_utils import write_tiny_chat_model

from vllmpy import LLM, PoolingParams, SamplingParams
from vllmpy.config import ConfigError

SENTENCES = ["hello world", "a somewhat longer sentence about pooling vectors",
             "x", "the quick brown fox jumps over the lazy dog " * 3]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A tiny random Llama saved by transformers (real weights), with a tokenizer; the
    transformers model on the same weights."""
    import transformers

    path = write_tiny_chat_model(tmp_path_factory.mktemp("embedder"))
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["matryoshka_dimensions"] = [16, 32]
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(path)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


@pytest.fixture(scope="module")
def embedder(decoder):
    # a small step budget: 4 prompts of up to ~40 tokens need several steps
    return LLM(decoder[0], device="cpu", dtype="float32", runner="pooling", num_blocks=32,
               max_model_len=128, max_num_batched_tokens=128)


def test_last_token_embeddings_equal_transformers(embedder, decoder):
    outs = embedder.embed(SENTENCES * 4, use_tqdm=False)
    tok = embedder.get_tokenizer()
    for text, out in zip(SENTENCES * 4, outs):
        ref = F.normalize(hidden(decoder[1], tok.encode(text))[-1], dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert embedder.engine.engine_core.get_stats().kv_cache_usage == 0.0


def test_matryoshka_dimensions_and_normalize(embedder, decoder):
    tok = embedder.get_tokenizer()
    h = hidden(decoder[1], tok.encode(SENTENCES[1]))[-1]
    out = embedder.embed(SENTENCES[1], PoolingParams(dimensions=16), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                               F.normalize(h[:16], dim=-1), atol=1e-5, rtol=1e-4)
    raw = embedder.embed(SENTENCES[1], PoolingParams(normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), h, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="matryoshka dimensions"):
        embedder.embed(SENTENCES[1], PoolingParams(dimensions=20), use_tqdm=False)


def test_encode_returns_every_token_state(embedder, decoder):
    tok = embedder.get_tokenizer()
    ids = tok.encode(SENTENCES[3])
    out = embedder.encode(SENTENCES[3], use_tqdm=False)[0]
    torch.testing.assert_close(out.outputs.data, hidden(decoder[1], ids), atol=1e-5,
                               rtol=1e-4)
    assert out.prompt_token_ids == ids


def test_score_is_the_cosine_of_embeddings(embedder, decoder):
    tok = embedder.get_tokenizer()
    scores = embedder.score(SENTENCES[0], SENTENCES[1:3], use_tqdm=False)
    base = hidden(decoder[1], tok.encode(SENTENCES[0]))[-1]
    for text, s in zip(SENTENCES[1:3], scores):
        other = hidden(decoder[1], tok.encode(text))[-1]
        assert s.outputs.score == pytest.approx(F.cosine_similarity(base, other, dim=0).item(),
                                                abs=1e-5)
    with pytest.raises(ValueError, match="same length"):
        embedder.score(SENTENCES[:2], SENTENCES[:3], use_tqdm=False)


def test_too_long_is_refused_or_truncated(embedder, decoder):
    text = "word " * 200
    with pytest.raises(ValueError, match="maximum input length is 128 tokens.*truncate"):
        embedder.embed(text, use_tqdm=False)
    out = embedder.embed(text, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 128
    ids = embedder.get_tokenizer().encode(text)[:128]
    ref = F.normalize(hidden(decoder[1], ids)[-1], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)


def test_tasks_the_model_does_not_serve_are_refused(embedder, decoder):
    with pytest.raises(ValueError, match="is a pooling model .*does not generate text"):
        embedder.generate("hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="does not serve the classify task"):
        embedder.classify("hi", use_tqdm=False)
    plain = LLM(decoder[0], device="cpu", dtype="float32", num_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="does not serve the embed task.*--runner pooling"):
        plain.embed("hi", use_tqdm=False)
    assert plain.generate("hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_mean_pooling_by_pooler_config(decoder):
    llm = LLM(decoder[0], device="cpu", dtype="float32", runner="pooling", num_blocks=16,
              max_model_len=64, pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    tok = llm.get_tokenizer()
    out = llm.embed(SENTENCES[1], use_tqdm=False)[0]
    ref = hidden(decoder[1], tok.encode(SENTENCES[1])).mean(dim=0)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("flags, message", [
    (dict(pooler_config='{"pooling_type": "MAX"}'), "pooling_type must be one of"),
    (dict(pooler_config='{"pooling": "MEAN"}'), "unknown or unsupported keys"),
    (dict(pooler_config='{"pooling_type": "MEAN"}', runner="generate"),
     "applies to a pooling model"),
    (dict(convert="none"), "needs --convert embed"),
])
def test_bad_pooling_flags_are_refused(decoder, flags, message):
    kwargs = dict(runner="pooling", device="cpu", dtype="float32", num_blocks=16,
                  max_model_len=64)
    kwargs.update(flags)
    with pytest.raises(ConfigError, match=message):
        LLM(decoder[0], **kwargs)


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling task must be one of"):
        PoolingParams(task="generate")
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
