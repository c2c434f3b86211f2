"""OLMoE (q/k norms over the whole projection, a softmax-routed MoE MLP in every layer,
optional clip_qkv and top-k renormalisation) against transformers' OlmoeForCausalLM on tiny
random weights, from the Hugging Face directory and from a GGUF written the way llama.cpp's
converter writes it."""

from __future__ import annotations

import gguf
import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.loader.gguf_loader import open_gguf
from vllmpy.models.olmoe import OlmoeConfig, OlmoeForCausalLM
from vllmpy.models.registry import text_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5, num_experts=8,
            num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    # the released models' shape: one kv head per head, raw top-k probabilities, no clip
    "plain": dict(num_key_value_heads=4, norm_topk_prob=False, tie_word_embeddings=False),
    # grouped kv heads, renormalised top-k, q/k/v clamped, biases, tied embeddings
    "clip": dict(num_key_value_heads=2, norm_topk_prob=True, clip_qkv=1.5,
                 attention_bias=True, tie_word_embeddings=True),
}


def _make(kind: str, path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.OlmoeForCausalLM(tf.OlmoeConfig(**BASE, **CONFIGS[kind]))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.15)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(12, 30, (n,), generator=g).tolist()
    return [torch.randint(0, BASE["vocab_size"], (k,), generator=g).tolist() for k in lens]


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"olmoe-{request.param}")
    return request.param, path, _make(request.param, path)


def test_greedy_and_logprobs_match_transformers(tiny):
    kind, path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=f"olmoe {kind}")


_GGUF_PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate": "ffn_gate_inp"}
_GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def _write_gguf(path, model_dir, hf_model) -> str:
    """What llama.cpp's OlmoeModel writes (f32) from the saved checkpoint: the common keys,
    the expert count and top-k, rms eps 1e-5 whatever the config says, no clamp and no
    norm_topk_prob; each projection's experts stacked into one [E, out, in] tensor; q/k
    rows as in Hugging Face."""
    import safetensors.torch as st

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "olmoe")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    state = st.load_file(str(model_dir / "model.safetensors"))  # one tensor per expert
    for name, p in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts." in name:
            continue  # stacked below
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            name = f"blk.{layer}.{_GGUF_PARTS[module]}.{suffix}"
        else:
            name = _GGUF_GLOBALS[name]
        writer.add_tensor(name, p.float().numpy())
    for layer in range(cfg.num_hidden_layers):
        for proj, part in (("down_proj", "ffn_down_exps"), ("gate_proj", "ffn_gate_exps"),
                           ("up_proj", "ffn_up_exps")):
            stacked = torch.stack([state[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]
                                   for e in range(cfg.num_experts)])  # [E, out, in]
            writer.add_tensor(f"blk.{layer}.{part}.weight", stacked.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_matches_transformers(tiny, tmp_path):
    """The released models' shape (no renormalisation, which is how llama.cpp runs every
    olmoe file) from an olmoe GGUF."""
    kind, path, hf_model = tiny
    if kind != "plain":
        pytest.skip("llama.cpp runs olmoe files without clip_qkv or top-k renormalisation")
    gguf_path = _write_gguf(tmp_path / "olmoe.gguf", path, hf_model)
    config = text_config(open_gguf(gguf_path).hf_config)
    assert isinstance(config, OlmoeConfig)
    assert (config.num_experts, config.num_experts_per_tok, config.intermediate_size,
            config.norm_topk_prob, config.clip_qkv) == (8, 2, 32, False, None)
    prompts = _prompts(3, seed=3)
    outs = _llm(gguf_path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=3 * 16, label="olmoe gguf")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens (routing and clamping of a token do not depend on its batch)."""
    kind, path, _ = tiny
    if kind != "clip":
        pytest.skip("one config covers the schedule")
    prompts = _prompts(5, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = _llm(path)
    alone = [base.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = _llm(path, block_size=4, num_blocks=16, max_model_len=48,
                 max_num_batched_tokens=7)
    together = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert together == alone
    assert small.engine.engine_core.scheduler.num_preemptions_total > 0


def test_config_reading_and_refusals():
    arch = "OlmoeForCausalLM"
    base = dict(BASE, architectures=[arch])
    cfg = OlmoeConfig.from_hf({**base, "clip_qkv": 8}, arch)
    assert (cfg.num_experts, cfg.clip_qkv, cfg.norm_topk_prob) == (8, 8.0, False)
    with pytest.raises(ConfigError, match="hidden_act"):
        OlmoeConfig.from_hf({**base, "hidden_act": "gelu"}, arch)
    with pytest.raises(ConfigError, match="clip_qkv"):
        OlmoeConfig.from_hf({**base, "clip_qkv": -1.0}, arch)
    with pytest.raises(ConfigError, match="head_dim"):
        OlmoeConfig.from_hf({**base, "head_dim": 32}, arch)
    with pytest.raises(ConfigError, match="sliding_window"):
        OlmoeConfig.from_hf({**base, "sliding_window": 64}, arch)
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        OlmoeConfig.from_hf({**base, "norm_topk_prob": "yes"}, arch)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        OlmoeForCausalLM(OlmoeConfig.from_hf({**base, "num_experts_per_tok": 9}, arch))


def test_absent_keys_read_as_transformers_defaults():
    import transformers as tf

    minimal = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4,
               "num_hidden_layers": 2}
    hf = tf.OlmoeConfig(**minimal)
    ours = text_config({"architectures": ["OlmoeForCausalLM"], **minimal})
    assert (ours.max_position_embeddings, ours.num_key_value_heads, ours.tie_word_embeddings,
            ours.rms_norm_eps, ours.intermediate_size, ours.num_experts,
            ours.num_experts_per_tok, ours.norm_topk_prob, ours.clip_qkv,
            ours.attention_bias, ours.rope_theta) == (
        hf.max_position_embeddings, hf.num_key_value_heads, hf.tie_word_embeddings,
        hf.rms_norm_eps, hf.intermediate_size, hf.num_experts, hf.num_experts_per_tok,
        hf.norm_topk_prob, hf.clip_qkv, hf.attention_bias, hf.rope_parameters["rope_theta"])
