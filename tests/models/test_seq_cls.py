"""Decoders as classifiers and rerankers, against transformers on tiny random weights:
a ``Qwen3ForSequenceClassification`` checkpoint (its ``score`` head on the last token),
and a causal Qwen3 served as Qwen3-Reranker's yes/no form through --hf-overrides."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from server_utils import write_tiny_chat_model

from vllmpy import LLM
from vllmpy.config import ConfigError

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
TEXTS = ["is the sky blue? yes", "a query and a document", "x"]


def qwen3_dir(tmp_path, name: str, config: dict) -> str:
    """A tokenizer directory (SmolLM2's tokenizer) with ``config`` as its config.json."""
    path = write_tiny_chat_model(tmp_path / name)
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("seq_cls")


def test_score_head_equals_transformers(tmp):
    import transformers

    path = qwen3_dir(tmp, "cls", dict(QWEN3, architectures=["Qwen3ForSequenceClassification"],
                                      id2label={"0": "neg", "1": "neu", "2": "pos"},
                                      label2id={"neg": 0, "neu": 1, "pos": 2}))
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(
        transformers.AutoConfig.from_pretrained(path)).eval()
    model.save_pretrained(path, safe_serialization=True)
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=16, max_model_len=128)
    tok = llm.get_tokenizer()
    got = llm.classify(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, got):
        with torch.no_grad():
            logits = model(torch.tensor([tok.encode(text)])).logits[0]
        torch.testing.assert_close(torch.tensor(out.outputs.probs), logits.softmax(-1),
                                   atol=1e-5, rtol=1e-4)


def test_qwen3_reranker_yes_no_form(tmp):
    import transformers

    path = qwen3_dir(tmp, "lm", QWEN3)
    torch.manual_seed(1)
    lm = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(path)).eval()
    lm.save_pretrained(path, safe_serialization=True)
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=16, max_model_len=128,
              hf_overrides=RERANKER)
    tok = llm.get_tokenizer()
    no, yes = (tok.encode(t, add_special_tokens=False)[0] for t in ("no", "yes"))
    scores = llm.score("query: is the sky blue?", TEXTS, use_tqdm=False)
    for text, s in zip(TEXTS, scores):
        ids = tok.encode("query: is the sky blue?") + tok.encode(text)
        # the pair's tokens, as the engine joins a pair without a pair template
        assert s.prompt_token_ids[:len(ids)] == ids[:len(s.prompt_token_ids)]
        with torch.no_grad():
            logits = lm(torch.tensor([s.prompt_token_ids])).logits[0, -1]
        want = torch.sigmoid(logits[yes] - logits[no]).item()
        assert s.outputs.score == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="does not generate text"):
        llm.generate("hi")


def test_bad_overrides_are_refused(tmp):
    path = str(tmp / "lm")
    bad = dict(RERANKER, classifier_from_token=["no"])
    with pytest.raises(ConfigError, match="two tokens"):
        LLM(path, device="cpu", dtype="float32", num_blocks=16, hf_overrides=bad)
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(path, device="cpu", dtype="float32", num_blocks=16, hf_overrides="{x")
    shutil.rmtree(tmp / "lm")


def test_qwen3_as_a_last_token_embedder(tmp):
    """Qwen3-Embedding's recipe: the causal Qwen3 with --runner pooling, its last token's
    final state, normalized."""
    import transformers

    path = qwen3_dir(tmp, "embed", QWEN3)
    torch.manual_seed(2)
    lm = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(path)).eval()
    lm.save_pretrained(path, safe_serialization=True)
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=16, max_model_len=128,
              runner="pooling")
    tok = llm.get_tokenizer()
    for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
        with torch.no_grad():
            last = lm.model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                                   torch.nn.functional.normalize(last, dim=-1),
                                   atol=1e-5, rtol=1e-4)
