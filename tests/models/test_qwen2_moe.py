"""Qwen2-MoE (sparse MoE MLPs with softmax top-k routing and a sigmoid-gated shared expert,
dense MLPs on the ``mlp_only_layers``, q/k/v biases, optional sliding windows) against
transformers' Qwen2MoeForCausalLM on tiny random weights, from the Hugging Face directory
and from a ``qwen2moe`` GGUF written the way llama.cpp's converter writes it."""

from __future__ import annotations

import gguf
import pytest
import safetensors.torch as st
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.loader.gguf_loader import open_gguf
from vllmpy.models.qwen2_moe import Qwen2MoeConfig
from vllmpy.models.registry import text_config

ARCH = "Qwen2MoeForCausalLM"
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
CONFIGS = {
    # the real models' pattern (every layer sparse), here with top-k renormalised
    "sparse": dict(decoder_sparse_step=1, norm_topk_prob=True),
    # a dense layer between sparse ones, raw top-k probabilities, tied embeddings, and a
    # window of 12 on layers 0 and 2 (transformers' rule: even layers below
    # max_window_layers); prompts and continuations run well past it
    "mixed": dict(decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False,
                  tie_word_embeddings=True, use_sliding_window=True, sliding_window=12,
                  max_window_layers=3),
}
# what llama.cpp runs for qwen2moe: every layer sparse, raw top-k probabilities
GGUF_CONFIG = dict(decoder_sparse_step=1, norm_topk_prob=False)


def _make(overrides: dict, path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**{**BASE, **overrides}))
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
    path = tmp_path_factory.mktemp(f"qwen2moe-{request.param}")
    return request.param, path, _make(CONFIGS[request.param], path)


def test_greedy_and_logprobs_match_transformers(tiny):
    kind, path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=f"qwen2moe {kind}")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens (a token's routing and window do not depend on its batch)."""
    kind, path, _ = tiny
    if kind != "mixed":
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


# ---- GGUF ------------------------------------------------------------------------------

_GGUF_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def _write_gguf(path, hf_dir, hf_model, shexp_gate: str) -> str:
    """What llama.cpp's Qwen2MoeModel writes from a Hugging Face directory: the common
    keys, the expert counts and sizes, every expert's projection stacked [E, out, in]
    into ``ffn_{gate,up,down}_exps``, f32 throughout; the shared expert's gate as the
    [1, hidden] matrix (today's converter) or squeezed to [hidden] (older files)."""
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    tensors = st.load_file(str(hf_dir / "model.safetensors"))
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name in _GGUF_GLOBALS:
            writer.add_tensor(_GGUF_GLOBALS[name], t.float().numpy())
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        if module.startswith("mlp.experts."):
            _, _, expert, proj = module.split(".")
            experts.setdefault((layer, proj), {})[int(expert)] = t
            continue
        if module == "mlp.shared_expert_gate" and shexp_gate == "vector":
            t = t.reshape(-1)
        writer.add_tensor(f"blk.{layer}.{_GGUF_PARTS[module]}.{suffix}", t.float().numpy())
    for (layer, proj), per_expert in experts.items():
        stacked = torch.stack([per_expert[e] for e in range(cfg.num_experts)])
        part = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                "down_proj": "ffn_down_exps"}[proj]
        writer.add_tensor(f"blk.{layer}.{part}.weight", stacked.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2moe-gguf-src")
    return path, _make(GGUF_CONFIG, path)


@pytest.mark.parametrize("shexp_gate", ["matrix", "vector"])
def test_gguf_matches_transformers(gguf_source, tmp_path, shexp_gate):
    hf_dir, hf_model = gguf_source
    gguf_path = _write_gguf(tmp_path / "qwen2moe.gguf", hf_dir, hf_model, shexp_gate)
    config = text_config(open_gguf(gguf_path).hf_config)
    assert isinstance(config, Qwen2MoeConfig)
    assert (config.sparse_layers, config.norm_topk_prob, config.qkv_bias) == (
        (True,) * 3, False, True)
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (32, 48)
    prompts = _prompts(3, seed=3)
    outs = _llm(gguf_path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=3 * 16,
                         label=f"qwen2moe gguf ({shexp_gate} shexp gate)")


# ---- config ----------------------------------------------------------------------------

def _read(**overrides) -> Qwen2MoeConfig:
    return Qwen2MoeConfig.from_hf({**BASE, "architectures": [ARCH], **overrides}, ARCH)


def test_config_reading_matches_transformers():
    import transformers as tf

    assert _read(decoder_sparse_step=2, mlp_only_layers=[1]).sparse_layers == (
        False, False, False)
    assert _read(mlp_only_layers=[2]).sparse_layers == (True, True, False)
    assert _read(num_experts=0).sparse_layers == (False, False, False)
    assert _read(qkv_bias=False).qkv_bias is False
    # which layers slide when layer_types is absent: as transformers derives it
    for below in (1, 4, 28):
        kwargs = dict(num_hidden_layers=5, use_sliding_window=True, sliding_window=8,
                      max_window_layers=below)
        hf = tf.Qwen2MoeConfig(**{**BASE, **kwargs})
        expected = tuple(8 if kind == "sliding_attention" else None for kind in hf.layer_types)
        assert _read(**kwargs).layer_windows == expected
    # without use_sliding_window the window is ignored, as transformers ignores it
    assert _read(sliding_window=8).layer_windows == (None, None, None)
    cfg = _read(use_sliding_window=True, sliding_window=8,
                layer_types=["full_attention", "sliding_attention", "full_attention"])
    assert cfg.layer_windows == (None, 8, None)


@pytest.mark.parametrize("overrides, field", [
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    (dict(mlp_only_layers=["1"]), "mlp_only_layers"),
    (dict(use_sliding_window=True, sliding_window=None), "sliding_window"),
    (dict(layer_types=["sliding_attention"] * 3), "use_sliding_window"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_config_refusals(overrides, field):
    with pytest.raises(ConfigError, match=field):
        _read(**overrides)
