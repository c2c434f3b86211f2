"""Tiny random-weight Cohere and Cohere2 models against transformers on the same weights,
and from GGUF files written as llama.cpp's converters write them ("command-r",
"cohere2"). Cohere: per-head q/k LayerNorms, a logit scale; Cohere2: three sliding layers
of every four (windows shorter than the prompts), the fourth global and without rotary."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hf_oracle import assert_greedy_match, assert_outputs_match, hf_scored

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.cohere import CohereConfig

VOCAB, POSITIONS, WINDOW = 384, 128, 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
SHORT = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _make(kind: str, path, **overrides) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=POSITIONS, logit_scale=0.5, bos_token_id=0,
                eos_token_id=0, pad_token_id=0)
    if kind == "cohere":
        cfg = tf.CohereConfig(**args | dict(num_hidden_layers=2, use_qk_norm=True)
                              | overrides)
        model = tf.CohereForCausalLM(cfg)
    else:  # the default pattern: layers 0-2 slide, layer 3 is global
        cfg = tf.Cohere2Config(**args | dict(num_hidden_layers=4, sliding_window=WINDOW)
                               | overrides)
        model = tf.Cohere2ForCausalLM(cfg)
    with torch.no_grad():  # larger than default weights: decisive logits, long greedy runs
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.2)  # Cohere's norms hold one weight row per head: use them
    model = model.float().eval()
    model.save_pretrained(path)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 40, (n,), generator=g).tolist()  # past Cohere2's window
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


def _llm(path, device: str = "cpu", **kwargs) -> LLM:
    args = dict(block_size=16, num_blocks=64) | kwargs
    return LLM(str(path), skip_tokenizer_init=True, device=device, dtype="float32", **args)


@pytest.fixture(scope="module", params=["cohere", "cohere2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _make(request.param, path)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_logprobs_match_transformers(tiny, device):
    kind, path, hf_model = tiny
    prompts = _prompts(6)
    assert_outputs_match(_llm(path, device).generate(prompts, GREEDY), hf_model, prompts,
                         min_tokens=6 * 16, label=kind)


def test_cohere_with_biases_and_no_qk_norm_matches_transformers(tmp_path):
    hf_model = _make("cohere", tmp_path, use_qk_norm=False, attention_bias=True)
    prompts = _prompts(4, seed=3)
    assert_outputs_match(_llm(tmp_path).generate(prompts, GREEDY), hf_model, prompts,
                         min_tokens=4 * 16, label="cohere with biases")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together, one at a time, in prefill chunks of 7 tokens, and under preemption: the
    same greedy tokens, and every block is free afterwards."""
    _, path, _ = tiny
    prompts = _prompts(6, seed=2)
    base = _llm(path)
    together = [o.outputs[0].token_ids for o in base.generate(prompts, SHORT)]
    assert [base.generate([p], SHORT)[0].outputs[0].token_ids for p in prompts] == together
    chunked = _llm(path, max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, SHORT)] == together
    # 16 blocks of 4 tokens cannot hold 6 requests of 36 to 55 tokens: preemption is forced
    small = _llm(path, block_size=4, num_blocks=16, max_model_len=64)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, SHORT)] == together
    core = small.engine.engine_core
    assert core.scheduler.num_preemptions_total > 0
    assert core.kv_cache_manager.num_free_blocks == 16


def test_cohere2_layer_kinds():
    """sliding_window_pattern (older configs) slides every layer but each pattern-th; the
    global layers do not rotate."""
    base = {"architectures": ["Cohere2ForCausalLM"], "vocab_size": 8, "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 6, "intermediate_size": 16}
    cfg = CohereConfig.from_hf(base | {"sliding_window": 32, "sliding_window_pattern": 3},
                               "Cohere2ForCausalLM")
    assert cfg.layer_windows == (32, 32, None, 32, 32, None)
    assert cfg.layer_rotary == (True, True, False, True, True, False)
    with pytest.raises(ConfigError, match="use_qk_norm"):
        CohereConfig.from_hf(base | {"use_qk_norm": True}, "Cohere2ForCausalLM")


# Hugging Face module -> llama.cpp tensor (gguf-py's tensor map for both architectures)
_GGUF_PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}


def _write_gguf(kind: str, hf_model, path) -> str:
    """What llama.cpp's CommandR2Model / Cohere2Model converters write: TextModel's common
    keys, the logit scale, no rope scaling; cohere2 adds the window, the vocabulary size
    and the rotary dims (not the layer pattern). The head is tied: no output tensor."""
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "command-r" if kind == "cohere" else "cohere2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    writer.add_logit_scale(cfg.logit_scale)
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    if kind == "cohere2":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(cfg.head_dim)
    for name, tensor in hf_model.state_dict().items():
        module, _, suffix = name.rpartition(".")
        if module == "lm_head":
            continue
        if module.startswith("model.layers."):
            _, _, layer, part = module.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_PARTS[part]}.{suffix}"
        else:
            gguf_name = f"{_GGUF_GLOBAL[module]}.{suffix}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_matches_transformers(tiny, tmp_path):
    kind, _, hf_model = tiny
    path = _write_gguf(kind, hf_model, tmp_path / f"{kind}.gguf")
    prompts = _prompts(4, seed=4)
    compared = 0
    for prompt, out in zip(prompts, _llm(path).generate(prompts, GREEDY)):
        ours = list(out.outputs[0].token_ids)
        compared += assert_greedy_match(ours, hf_scored(hf_model, prompt, ours),
                                        f"{kind} gguf")
    assert compared >= 4 * 16


@pytest.mark.parametrize("architecture", ["CohereForCausalLM", "Cohere2ForCausalLM"])
def test_absent_keys_read_as_transformers_defaults(architecture):
    import transformers as tf

    minimal = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 16}
    hf = getattr(tf, architecture.replace("ForCausalLM", "Config"))(**minimal)
    ours = CohereConfig.from_hf({"architectures": [architecture], **minimal}, architecture)
    windows = (tuple(hf.sliding_window if kind == "sliding_attention" else None
                     for kind in hf.layer_types)
               if architecture == "Cohere2ForCausalLM" else (None,) * hf.num_hidden_layers)
    assert (ours.max_position_embeddings, ours.num_key_value_heads, ours.tie_word_embeddings,
            ours.rope_theta, ours.logit_scale, ours.layer_windows, ours.head_dim,
            ours.layer_norm_eps) == (
        hf.max_position_embeddings, hf.num_key_value_heads, hf.tie_word_embeddings,
        hf.rope_parameters["rope_theta"], hf.logit_scale, windows,
        hf.hidden_size // hf.num_attention_heads, hf.layer_norm_eps)
