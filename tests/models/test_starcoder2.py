"""A tiny random-weight Starcoder2 against transformers on the same weights, with a
sliding window shorter than its prompts; and from a GGUF file written as llama.cpp's
converter writes one (no window: llama.cpp runs starcoder2 with full attention)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hf_oracle import assert_greedy_match, assert_outputs_match, hf_scored

from vllmpy import LLM, SamplingParams
from vllmpy.models.starcoder2 import Starcoder2Config

VOCAB, POSITIONS = 384, 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
SHORT = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
WINDOW = 12


def _make(path, **overrides) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=POSITIONS, sliding_window=WINDOW,
                bos_token_id=0, eos_token_id=0) | overrides
    model = tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**args))
    with torch.no_grad():  # larger than default weights: decisive logits, long greedy runs
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model = model.float().eval()
    model.save_pretrained(path)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 40, (n,), generator=g).tolist()  # past the window
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


def _llm(path, device: str = "cpu", **kwargs) -> LLM:
    args = dict(block_size=16, num_blocks=64) | kwargs
    return LLM(str(path), skip_tokenizer_init=True, device=device, dtype="float32", **args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("starcoder2")
    return path, _make(path)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_logprobs_match_transformers(tiny, device):
    path, hf_model = tiny
    prompts = _prompts(6)
    assert_outputs_match(_llm(path, device).generate(prompts, GREEDY), hf_model, prompts,
                         min_tokens=6 * 16, label="starcoder2")


def test_without_biases_matches_transformers(tmp_path):
    hf_model = _make(tmp_path, use_bias=False, tie_word_embeddings=False)
    prompts = _prompts(4, seed=3)
    assert_outputs_match(_llm(tmp_path).generate(prompts, GREEDY), hf_model, prompts,
                         min_tokens=4 * 16, label="starcoder2 without biases")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together, one at a time, in prefill chunks of 7 tokens, and under preemption: the
    same greedy tokens, and every block is free afterwards."""
    path, _ = tiny
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


# Hugging Face module -> llama.cpp tensor (gguf-py's tensor map for "starcoder2")
_GGUF_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                "lm_head": "output"}


def _write_gguf(hf_model, path) -> str:
    """What llama.cpp's converter writes for Starcoder2 (TextModel's common keys: no
    sliding window), the tensors under llama.cpp's names; a tied head has no output."""
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "starcoder2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_eps(cfg.norm_epsilon)
    for name, tensor in hf_model.state_dict().items():
        module, _, suffix = name.rpartition(".")
        if module == "lm_head" and cfg.tie_word_embeddings:
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


def test_gguf_matches_transformers(tmp_path):
    """The file has no window, so neither has the model transformers checks it against
    (the same weights: the same seed)."""
    hf_model = _make(tmp_path / "hf", sliding_window=None)
    path = _write_gguf(hf_model, tmp_path / "starcoder2.gguf")
    prompts = _prompts(4, seed=4)
    compared = 0
    for prompt, out in zip(prompts, _llm(path).generate(prompts, GREEDY)):
        ours = list(out.outputs[0].token_ids)
        compared += assert_greedy_match(ours, hf_scored(hf_model, prompt, ours),
                                        "starcoder2 gguf")
    assert compared >= 4 * 16


def test_absent_keys_read_as_transformers_defaults():
    import transformers as tf

    minimal = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 16}
    hf = tf.Starcoder2Config(**minimal)
    ours = Starcoder2Config.from_hf({"architectures": ["Starcoder2ForCausalLM"], **minimal},
                                    "Starcoder2ForCausalLM")
    assert (ours.max_position_embeddings, ours.num_key_value_heads, ours.tie_word_embeddings,
            ours.rope_theta, ours.layer_windows, ours.use_bias, ours.hidden_act,
            ours.norm_epsilon) == (
        hf.max_position_embeddings, hf.num_key_value_heads, hf.tie_word_embeddings,
        hf.rope_parameters["rope_theta"], (hf.sliding_window,) * hf.num_hidden_layers,
        hf.use_bias, hf.hidden_act, hf.norm_epsilon)
