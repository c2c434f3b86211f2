"""Gemma 3 as a bidirectional encoder (EmbeddingGemma's architecture) against transformers'
Gemma3TextModel on tiny random weights: sequences longer than the sliding layers' reach,
packed in one step, so both the full and the windowed bidirectional masks are exercised."""

from __future__ import annotations

import pytest
import torch

from vllmpy import LLM
from vllmpy.config import ConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        sliding_window=12, layer_types=["sliding_attention", "full_attention",
                                        "sliding_attention"],
        use_bidirectional_attention=True, query_pre_attn_scalar=32)
    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(cfg).eval()
    path = tmp_path_factory.mktemp("gemma3-encoder")
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


def test_hidden_states_equal_transformers(tiny):
    path, model = tiny
    llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True,
              pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    torch.manual_seed(1)
    prompts = [torch.randint(3, 128, (n,)).tolist() for n in (30, 5, 19)]  # reach is 7
    outs = llm.encode(prompts, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            want = model(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(out.outputs.data, want, atol=2e-5, rtol=1e-4)
    means = llm.embed(prompts, use_tqdm=False)
    torch.testing.assert_close(torch.tensor(means[0].outputs.embedding),
                               outs[0].outputs.data.mean(0), atol=1e-5, rtol=1e-5)


def test_a_causal_text_model_is_refused(tiny, tmp_path):
    import json
    import shutil

    shutil.copytree(tiny[0], tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["use_bidirectional_attention"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="use_bidirectional_attention is not true"):
        LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True)
