"""Phi-3 (fused qkv_proj / gate_up_proj, LongRoPE, partial rotary, sliding window) against
transformers' Phi3ForCausalLM on tiny random weights, from the Hugging Face directory and
from a GGUF written the way llama.cpp's converter writes one."""

from __future__ import annotations

import math

import gguf
import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.phi3 import Phi3Config

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
            original_max_position_embeddings=128, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _longrope(pairs: int) -> dict:
    """LongRoPE factors for ``pairs`` rotating pairs (distinct, so a swap would show)."""
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(pairs)],
            "long_factor": [2.0 + 0.5 * i for i in range(pairs)]}


# Phi-3.5-mini's shape (LongRoPE over whole heads, untied) and Phi-4-mini's (three quarters
# of each head rotate, tied embeddings), the latter with a window shorter than the requests
CONFIGS = {
    "longrope": dict(rope_scaling=_longrope(8), tie_word_embeddings=False),
    "partial_window": dict(rope_scaling=_longrope(6), partial_rotary_factor=0.75,
                           sliding_window=12, tie_word_embeddings=True),
}


def _make(kind: str, path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(tf.Phi3Config(**BASE, **CONFIGS[kind]))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    """Prompts of 20 to 40 tokens: with 32 generated, past the window and short of
    original_max_position_embeddings (128), where transformers rotates with short_factor."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 41, (n,), generator=g).tolist()
    return [torch.randint(0, BASE["vocab_size"], (k,), generator=g).tolist() for k in lens]


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"phi3-{request.param}")
    return request.param, path, _make(request.param, path)


def test_greedy_and_logprobs_match_transformers(tiny):
    kind, path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=f"phi3 {kind}")


def _write_gguf(path, hf_model) -> str:
    """The tensors and metadata llama.cpp's Phi3MiniModel writes (no tokenizer: the engine
    runs on token ids)."""
    cfg = hf_model.config
    rope = cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size)
                                    // cfg.num_attention_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(cfg.sliding_window or 0)
    scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
    writer.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])))
    assert len(rope["long_factor"]) * 2 == int(head_dim * rope["partial_rotary_factor"])
    tensors = {"rope_factors_long.weight": torch.tensor(rope["long_factor"]),
               "rope_factors_short.weight": torch.tensor(rope["short_factor"])}
    names = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, p in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            name = f"blk.{layer}.{names[module]}.{suffix}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]
        tensors[name] = p
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_matches_transformers(tmp_path):
    """Partial rotary, LongRoPE (factors from the two tensors) and the window, from GGUF."""
    hf_model = _make("partial_window", tmp_path / "hf")
    gguf_path = _write_gguf(tmp_path / "phi3.gguf", hf_model)
    prompts = _prompts(3, seed=3)
    outs = _llm(gguf_path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=3 * 16, label="phi3 gguf")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens, and every block is free afterwards."""
    kind, path, _ = tiny
    if kind != "partial_window":
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


def test_refusals_name_the_key():
    base = dict(BASE, architectures=["Phi3ForCausalLM"])
    with pytest.raises(ConfigError, match="hidden_act"):
        Phi3Config.from_hf({**base, "hidden_act": "relu"}, "Phi3ForCausalLM")
    with pytest.raises(ConfigError, match="'linear'"):
        Phi3Config.from_hf({**base, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                           "Phi3ForCausalLM")
    # a legacy LongRoPE dict takes the top-level original length, as transformers does
    legacy = {**base, "rope_scaling": {"type": "su", **_longrope(8)}}
    legacy["rope_scaling"].pop("rope_type")
    cfg = Phi3Config.from_hf(legacy, "Phi3ForCausalLM")
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["original_max_position_embeddings"] == 128


def test_absent_keys_read_as_transformers_defaults():
    import transformers as tf

    minimal = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4,
               "num_hidden_layers": 4, "intermediate_size": 16}
    hf = tf.Phi3Config(**minimal)
    ours = Phi3Config.from_hf({"architectures": ["Phi3ForCausalLM"], **minimal},
                              "Phi3ForCausalLM")
    assert (ours.max_position_embeddings, ours.num_key_value_heads, ours.tie_word_embeddings,
            ours.rms_norm_eps, ours.rope_theta, ours.rope_scaling, ours.layer_windows) == (
        hf.max_position_embeddings, hf.num_key_value_heads, hf.tie_word_embeddings,
        hf.rms_norm_eps, hf.rope_parameters["rope_theta"], None, (hf.sliding_window,) * 4)
