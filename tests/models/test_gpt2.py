"""A tiny random-weight GPT-2 against transformers on the same weights: from its Hugging
Face directory and from a GGUF file written as llama.cpp's converter writes one."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hf_oracle import assert_greedy_match, assert_outputs_match, hf_scored

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.gpt2 import GPT2Config

VOCAB, POSITIONS = 384, 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
SHORT = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _make(path, **overrides) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=64, n_layer=2,
                        n_head=4, bos_token_id=0, eos_token_id=0, **overrides)
    model = tf.GPT2LMHeadModel(cfg)
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
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


def _llm(path, device: str = "cpu", **kwargs) -> LLM:
    args = dict(block_size=16, num_blocks=64) | kwargs
    return LLM(str(path), skip_tokenizer_init=True, device=device, dtype="float32", **args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    return path, _make(path)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_logprobs_match_transformers(tiny, device):
    path, hf_model = tiny
    prompts = _prompts(6)
    assert_outputs_match(_llm(path, device).generate(prompts, GREEDY), hf_model, prompts,
                         min_tokens=6 * 16, label="gpt2")


def test_layer_scaled_attention_matches_transformers(tmp_path):
    """scale_attn_by_inverse_layer_idx divides layer i's scores by i + 1."""
    hf_model = _make(tmp_path, scale_attn_by_inverse_layer_idx=True)
    prompts = _prompts(3, seed=3)
    assert_outputs_match(_llm(tmp_path).generate(prompts, GREEDY), hf_model, prompts,
                         min_tokens=3 * 16, label="gpt2 scaled by layer")


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
    # 16 blocks of 4 tokens cannot hold 6 requests of up to 55 tokens: preemption is forced
    small = _llm(path, block_size=4, num_blocks=16, max_model_len=64)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, SHORT)] == together
    core = small.engine.engine_core
    assert core.scheduler.num_preemptions_total > 0
    assert core.kv_cache_manager.num_free_blocks == 16


def test_positions_past_n_positions_are_not_served(tiny):
    path, _ = tiny
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        _llm(path, max_model_len=POSITIONS + 1)


def test_cross_attention_is_refused():
    with pytest.raises(ConfigError, match="add_cross_attention"):
        GPT2Config.from_hf({"architectures": ["GPT2LMHeadModel"], "vocab_size": 8,
                            "n_embd": 8, "n_head": 2, "n_layer": 1,
                            "add_cross_attention": True}, "GPT2LMHeadModel")


_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _write_gguf(hf_model, path, quant: gguf.GGMLQuantizationType | None = None) -> str:
    """What llama.cpp's GPT2Model converter writes: the Conv1D weights transposed, the
    checkpoint's tensors under llama.cpp's names (no output.weight: the head is tied);
    with ``quant``, the blocks' matrices in that type."""
    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    names = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
    parts = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
             "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for name, tensor in hf_model.transformer.state_dict().items():
        module, _, suffix = name.rpartition(".")
        if not module.startswith("h."):
            writer.add_tensor(f"{names[module]}.{suffix}", tensor.numpy())
            continue
        _, layer, part = module.split(".", 2)
        gguf_name = f"blk.{layer}.{parts[part]}.{suffix}"
        if part in _CONV1D and suffix == "weight":
            array = np.ascontiguousarray(tensor.t().numpy())  # [out, in]
            if quant is not None:
                writer.add_tensor(gguf_name, gguf.quants.quantize(array, quant),
                                  raw_dtype=quant)
                continue
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _assert_gguf_greedy(hf_model, path, label: str) -> None:
    prompts = _prompts(4, seed=4)
    compared = 0
    for prompt, out in zip(prompts, _llm(path).generate(prompts, GREEDY)):
        ours = list(out.outputs[0].token_ids)
        compared += assert_greedy_match(ours, hf_scored(hf_model, prompt, ours), label)
    assert compared >= 4 * 16


def test_gguf_matches_transformers(tiny, tmp_path):
    _, hf_model = tiny
    _assert_gguf_greedy(hf_model, _write_gguf(hf_model, tmp_path / "gpt2.gguf"), "gpt2 gguf")


def test_quantized_gguf_matches_transformers(tmp_path):
    """Q8_0 matrices come as llama.cpp stores them, [out, in], and are not transposed
    again; transformers runs the same weights, rounded through Q8_0."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    hf_model = _make(tmp_path / "hf")
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith(tuple(f"{part}.weight" for part in _CONV1D)):
                rows = p.t().contiguous().numpy()
                rounded = gguf.quants.dequantize(gguf.quants.quantize(rows, q8_0), q8_0)
                p.copy_(torch.from_numpy(rounded).t())
    path = _write_gguf(hf_model, tmp_path / "gpt2-q8_0.gguf", quant=q8_0)
    _assert_gguf_greedy(hf_model, path, "gpt2 q8_0 gguf")


def test_absent_keys_read_as_transformers_defaults():
    import transformers as tf

    minimal = {"vocab_size": 64, "n_embd": 64, "n_head": 4, "n_layer": 2}
    hf = tf.GPT2Config(**minimal)
    ours = GPT2Config.from_hf({"architectures": ["GPT2LMHeadModel"], **minimal},
                              "GPT2LMHeadModel")
    assert (ours.max_position_embeddings, ours.n_inner, ours.tie_word_embeddings,
            ours.activation_function, ours.layer_norm_epsilon, ours.scale_attn_weights) == (
        hf.n_positions, 4 * hf.n_embd, hf.tie_word_embeddings, hf.activation_function,
        hf.layer_norm_epsilon, hf.scale_attn_weights)
