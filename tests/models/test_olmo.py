"""OLMo-2 (post-norms, q/k norms over the whole projection) and OLMo-3 (plus sliding windows
per layer_types, rope per layer kind) against transformers on tiny random weights, from the
Hugging Face directory and from GGUFs written the way llama.cpp's converter writes them."""

from __future__ import annotations

import gguf
import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.olmo3 import Olmo3Config

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=2)
CONFIGS = {
    "olmo2": dict(num_hidden_layers=2, attention_bias=True, tie_word_embeddings=False),
    # sliding, sliding, sliding, global (transformers' default pattern); the global layer
    # rotates with a linear-scaled rope at its own theta, the sliding ones plainly
    "olmo3": dict(num_hidden_layers=4, sliding_window=10, tie_word_embeddings=True,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                      "rope_theta": 20000.0},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0}}),
}


def _make(kind: str, path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "olmo2":
        model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**BASE, **CONFIGS[kind]))
    else:
        model = tf.Olmo3ForCausalLM(tf.Olmo3Config(**BASE, **CONFIGS[kind]))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0, 0.1)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    """20 to 40 tokens: with 32 generated, well past OLMo-3's window of 10."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 41, (n,), generator=g).tolist()
    return [torch.randint(0, BASE["vocab_size"], (k,), generator=g).tolist() for k in lens]


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _make(request.param, path)


def test_greedy_and_logprobs_match_transformers(tiny):
    kind, path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=kind)


_GGUF_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "post_attention_norm",
               "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_gguf(path, hf_model) -> str:
    """What llama.cpp's Olmo2Model writes for both families: the common keys (rope scaling
    and theta of the global layers, the sliding layers' theta as freq_base_swa), and for
    OLMo-3 the window and the per-layer sliding pattern; q/k rows as in Hugging Face."""
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "olmo2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "sliding_window", None) is not None:
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    globals_ = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for name, p in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            name = f"blk.{layer}.{_GGUF_PARTS[module]}.{suffix}"
        else:
            name = globals_[name]
        writer.add_tensor(name, p.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_matches_transformers(tiny, tmp_path):
    """OLMo-2 from an olmo2 GGUF; OLMo-3 from the same architecture name, told apart by its
    sliding-window pattern."""
    kind, _, hf_model = tiny
    gguf_path = _write_gguf(tmp_path / f"{kind}.gguf", hf_model)
    prompts = _prompts(3, seed=3)
    outs = _llm(gguf_path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=3 * 16, label=f"{kind} gguf")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens, and every block is free afterwards."""
    kind, path, _ = tiny
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


def test_olmo3_config_refusals_and_legacy_rope():
    base = dict(BASE, architectures=["Olmo3ForCausalLM"], num_hidden_layers=4)
    with pytest.raises(ConfigError, match="sliding_window"):
        Olmo3Config.from_hf({**base, "sliding_window": None}, "Olmo3ForCausalLM")
    with pytest.raises(ConfigError, match="hidden_act"):
        Olmo3Config.from_hf({**base, "hidden_act": "relu"}, "Olmo3ForCausalLM")
    # an older config: rope_scaling applies to the global layers, rope_theta to all
    cfg = Olmo3Config.from_hf({**base, "rope_theta": 1e6,
                               "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                              "Olmo3ForCausalLM")
    assert cfg.layer_windows == (4096, 4096, 4096, None)
    assert cfg.layer_ropes[0] == (1e6, None)
    assert cfg.layer_ropes[3] == (1e6, {"rope_type": "linear", "factor": 4.0})


@pytest.mark.parametrize("architecture", ["Olmo2ForCausalLM", "Olmo3ForCausalLM"])
def test_absent_keys_read_as_transformers_defaults(architecture):
    import transformers as tf

    from vllmpy.models.registry import text_config

    minimal = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4,
               "num_hidden_layers": 4, "intermediate_size": 16}
    hf = getattr(tf, architecture.replace("ForCausalLM", "Config"))(**minimal)
    ours = text_config({"architectures": [architecture], **minimal})
    kinds = getattr(hf, "layer_types", None) or ["full_attention"] * 4
    rope = hf.rope_parameters
    thetas = tuple(rope.get(kind, rope)["rope_theta"] for kind in kinds)
    windows = tuple(getattr(hf, "sliding_window", None) if kind == "sliding_attention"
                    else None for kind in kinds)
    assert (ours.max_position_embeddings, ours.num_key_value_heads, ours.tie_word_embeddings,
            ours.rms_norm_eps, ours.attention_bias, ours.layer_windows,
            tuple(theta for theta, _ in ours.layer_ropes)) == (
        hf.max_position_embeddings, hf.num_key_value_heads, hf.tie_word_embeddings,
        hf.rms_norm_eps, hf.attention_bias, windows, thetas)
