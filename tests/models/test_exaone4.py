"""EXAONE 4.0 (post-norms, per-head q/k norms, sliding and global layers, NoPE on the
global layers of a windowed config) against transformers' Exaone4ForCausalLM on tiny
random weights."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.exaone4 import Exaone4Config

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    # EXAONE-4.0-32B's shape: sliding, global, sliding, global; the global layers NoPE
    "hybrid": dict(num_hidden_layers=4, sliding_window=10, sliding_window_pattern=2,
                   tie_word_embeddings=False),
    # EXAONE-4.0-1.2B's: no window, every layer global and rotating (llama3-scaled here)
    "global": dict(num_hidden_layers=2, sliding_window=None, tie_word_embeddings=True,
                   layer_types=["full_attention"] * 2,
                   rope_parameters={"rope_type": "llama3", "factor": 4.0, "rope_theta": 10000.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32}),
}


def _make(kind: str, path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Exaone4ForCausalLM(tf.Exaone4Config(**BASE, **CONFIGS[kind]))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    """20 to 40 tokens: with 32 generated, well past the window of 10."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 41, (n,), generator=g).tolist()
    return [torch.randint(0, BASE["vocab_size"], (k,), generator=g).tolist() for k in lens]


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"exaone4-{request.param}")
    return request.param, path, _make(request.param, path)


def test_greedy_and_logprobs_match_transformers(tiny):
    kind, path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=f"exaone4 {kind}")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens, and every block is free afterwards."""
    kind, path, _ = tiny
    if kind != "hybrid":
        pytest.skip("one config covers the schedule")
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = _llm(path)
    alone = [base.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = _llm(path, block_size=4, num_blocks=24, max_model_len=80,
                 max_num_batched_tokens=7)
    together = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert together == alone
    core = small.engine.engine_core
    assert core.scheduler.num_preemptions_total > 0
    assert core.kv_cache_manager.num_free_blocks == 24


def test_config_reading_and_refusals():
    base = dict(BASE, architectures=["Exaone4ForCausalLM"], num_hidden_layers=4)
    cfg = Exaone4Config.from_hf({**base, "sliding_window": 8}, "Exaone4ForCausalLM")
    assert cfg.layer_windows == (8, 8, 8, None)  # transformers' default pattern of 4
    assert cfg.layer_rotary == (True, True, True, False)
    with pytest.raises(ConfigError, match="sliding_window_pattern"):
        Exaone4Config.from_hf({**base, "sliding_window_pattern": "LLLG"}, "Exaone4ForCausalLM")
    with pytest.raises(ConfigError, match="sliding_window"):
        Exaone4Config.from_hf({**base, "sliding_window": None,
                               "layer_types": ["sliding_attention"] * 4}, "Exaone4ForCausalLM")
    with pytest.raises(ConfigError, match="hidden_act"):
        Exaone4Config.from_hf({**base, "hidden_act": "relu"}, "Exaone4ForCausalLM")


def test_absent_keys_read_as_transformers_defaults():
    import transformers as tf

    minimal = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4,
               "num_hidden_layers": 4, "intermediate_size": 16}
    hf = tf.Exaone4Config(**minimal)
    ours = Exaone4Config.from_hf({"architectures": ["Exaone4ForCausalLM"], **minimal},
                                 "Exaone4ForCausalLM")
    windows = tuple(hf.sliding_window if kind == "sliding_attention" else None
                    for kind in hf.layer_types)
    assert (ours.max_position_embeddings, ours.num_key_value_heads, ours.tie_word_embeddings,
            ours.rms_norm_eps, ours.rope_theta, ours.layer_windows) == (
        hf.max_position_embeddings, hf.num_key_value_heads, hf.tie_word_embeddings,
        hf.rms_norm_eps, hf.rope_parameters["rope_theta"], windows)
