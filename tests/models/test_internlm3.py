"""InternLM3 against transformers on tiny random weights.

InternLM3 is remote code, so the oracle is a transformers class that computes what
``modeling_internlm3.py`` computes, on the same weights under the same tensor names, key
by key of the InternLM3 config.json we write:

- ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim`` (set apart from hidden_size / heads, as the 8B's
  128 is not), ``rms_norm_eps``, ``vocab_size``, ``max_position_embeddings``,
  ``tie_word_embeddings``, ``hidden_act`` (silu): the same keys of LlamaConfig, read the
  same way by both;
- ``rope_theta`` and ``rope_scaling`` {"rope_type": "dynamic", "factor": 6.0} (the 8B's):
  both models' dynamic NTK rope leaves the base unscaled below max_position_embeddings,
  where the requests stay, so Llama's rope_parameters with the same dict rotate alike;
- ``qkv_bias`` (q, k, v) and ``bias`` (o_proj and gate/up/down): equal, they are Llama's
  ``attention_bias`` (q, k, v, o) and ``mlp_bias``; ``qkv_bias`` true with ``bias``
  false is Qwen2 exactly (q/k/v biases only), our second oracle.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.internlm3 import InternLM3Config

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
ROPE = {"rope_type": "dynamic", "factor": 6.0}
# (qkv_bias, bias, head_dim)
CASES = {"no_bias": (False, False, 32), "biases": (True, True, 32),
         "qkv_bias_only": (True, False, 16)}


def _make(kind: str, path) -> torch.nn.Module:
    """The oracle model, saved under InternLM3's own config.json."""
    import transformers as tf

    qkv_bias, bias, head_dim = CASES[kind]
    torch.manual_seed(0)
    rope = {**ROPE, "rope_theta": 50000.0}
    if qkv_bias and not bias:
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**SHAPE, rope_parameters=rope))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            **SHAPE, head_dim=head_dim, attention_bias=qkv_bias, mlp_bias=bias,
            rope_parameters=rope))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.1)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    config = {"architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3",
              **SHAPE, "head_dim": head_dim, "hidden_act": "silu", "qkv_bias": qkv_bias,
              "bias": bias, "rope_theta": 50000.0, "rope_scaling": ROPE,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
              "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 41, (n,), generator=g).tolist()
    return [torch.randint(0, SHAPE["vocab_size"], (k,), generator=g).tolist() for k in lens]


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"internlm3-{request.param}")
    return request.param, path, _make(request.param, path)


def test_greedy_and_logprobs_match_transformers(tiny):
    kind, path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16,
                         label=f"internlm3 {kind}")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens, and every block is free afterwards."""
    kind, path, _ = tiny
    if kind != "biases":
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


def test_bias_keys_and_refusals():
    base = dict(SHAPE, architectures=["InternLM3ForCausalLM"])
    cfg = InternLM3Config.from_hf({**base, "qkv_bias": False, "bias": True},
                                  "InternLM3ForCausalLM")
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.mlp_bias) == (False, True, True)
    # a transformers-5 save spells them attention_bias / mlp_bias, and only alike
    cfg = InternLM3Config.from_hf({**base, "attention_bias": True, "mlp_bias": True},
                                  "InternLM3ForCausalLM")
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.mlp_bias) == (True, True, True)
    with pytest.raises(ConfigError, match="mlp_bias"):
        InternLM3Config.from_hf({**base, "attention_bias": True}, "InternLM3ForCausalLM")
    with pytest.raises(ConfigError, match="hidden_act"):
        InternLM3Config.from_hf({**base, "hidden_act": "gelu"}, "InternLM3ForCausalLM")
