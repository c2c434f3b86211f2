"""Qwen3-MoE (sparse MoE MLPs with softmax top-k routing, dense MLPs on the
``mlp_only_layers``) against transformers' Qwen3MoeForCausalLM on tiny random weights."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.qwen3_moe import Qwen3MoeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6,
            num_experts=8, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, tie_word_embeddings=False)
CONFIGS = {
    # the real models' pattern: every layer sparse, top-k renormalised
    "sparse": dict(decoder_sparse_step=1, norm_topk_prob=True),
    # a dense layer between sparse ones, raw top-k probabilities, tied embeddings
    "mixed": dict(decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False,
                  tie_word_embeddings=True),
}


def _make(kind: str, path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**{**BASE, **CONFIGS[kind]}))
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
    path = tmp_path_factory.mktemp(f"qwen3moe-{request.param}")
    return request.param, path, _make(request.param, path)


def test_greedy_and_logprobs_match_transformers(tiny):
    kind, path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=f"qwen3moe {kind}")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens (the routing of a token does not depend on its batch)."""
    kind, path, _ = tiny
    if kind != "sparse":
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
    base = dict(BASE, architectures=["Qwen3MoeForCausalLM"])
    cfg = Qwen3MoeConfig.from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": [1]},
                                 "Qwen3MoeForCausalLM")
    assert cfg.sparse_layers == (False, False, False)
    cfg = Qwen3MoeConfig.from_hf({**base, "mlp_only_layers": [2]}, "Qwen3MoeForCausalLM")
    assert cfg.sparse_layers == (True, True, False)
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        Qwen3MoeConfig.from_hf({**base, "decoder_sparse_step": 0}, "Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="hidden_act"):
        Qwen3MoeConfig.from_hf({**base, "hidden_act": "gelu"}, "Qwen3MoeForCausalLM")


def test_missing_expert_is_refused_by_name(tiny, tmp_path):
    import shutil

    import safetensors.torch as st

    kind, path, _ = tiny
    if kind != "sparse":
        pytest.skip("one config covers the loader")
    tensors = st.load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    st.save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(Exception, match=r"layers\.2\.mlp\.experts\.5\.down_proj"):
        _llm(tmp_path)


def test_gguf_matches_transformers(tiny, tmp_path):
    """A qwen3moe GGUF written from the same weights, as llama.cpp's converter writes it."""
    from models.moe_gguf import write_moe_gguf

    kind, _, hf_model = tiny
    if kind != "sparse":
        pytest.skip("llama.cpp renormalises qwen3moe's top-k: the sparse config does too")
    path = write_moe_gguf(tmp_path / "qwen3moe.gguf", hf_model, "qwen3moe")
    prompts = _prompts(3, seed=3)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=3 * 16, label="qwen3moe gguf")


def test_quantized_expert_gguf_runs_dequantized(tmp_path, capfd):
    """Q8_0 expert tensors and a dense layer (no router in the file): the experts are
    dequantized at load, said so at start-up, and equal transformers running gguf-py's
    dequantization of the same blocks."""
    import gguf
    from models.moe_gguf import write_moe_gguf

    dense = _make_config_variant(mlp_only_layers=[1])
    gguf_path = write_moe_gguf(tmp_path / "q8.gguf", dense, "qwen3moe",
                               expert_quant=gguf.GGMLQuantizationType.Q8_0)
    prompts = _prompts(3, seed=5)
    outs = _llm(gguf_path).generate(prompts, GREEDY)
    assert "MoE expert tensors (Q8_0) dequantized to float32" in capfd.readouterr().err
    assert_outputs_match(outs, dense, prompts, min_tokens=3 * 16, label="qwen3moe q8 experts")


def _make_config_variant(**overrides) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(7)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **{**BASE, **CONFIGS["sparse"], **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.15)
    return model.float().eval()


def test_moe_stats_summary_at_exit(tiny):
    """VT_MOE_STATS=1: the load of every MoE layer printed to stderr when the process ends;
    each of the 3 sparse layers routes every token of the run to top-k=2 experts."""
    import os
    import subprocess
    import sys

    kind, path, _ = tiny
    if kind != "sparse":
        pytest.skip("one config covers the summary")
    script = ("from vllmpy import LLM, SamplingParams\n"
              f"llm = LLM({str(path)!r}, skip_tokenizer_init=True, device='cpu', "
              "dtype='float32', block_size=16, num_blocks=16)\n"
              "llm.generate([[3, 4, 5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, "
              "ignore_eos=True))\n")
    env = {**os.environ, "VT_MOE_STATS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("  layer ")]
    assert len(lines) == 3, proc.stderr[-2000:]
    # 5 prompt tokens and 3 decoded ones (the 4th is sampled, never fed back) times k=2
    assert all(ln.split(": ", 1)[1].startswith("16 routed over 8 experts") for ln in lines), lines
    assert "all layers: 48 routed over 8 experts" in proc.stderr
