"""GPT-OSS (attention sinks, alternating sliding-window layers, q/k/v/o biases, YaRN
rotary, a biased top-k router over fused, transposed, interleaved experts with biases and
the clamped SwiGLU) against transformers' GptOssForCausalLM on tiny random weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.layers.moe import select_experts
from vllmpy.models.gpt_oss import GptOssConfig, GptOssForCausalLM

ARCH = "GptOssForCausalLM"
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 10000.0}
BASE = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
            num_local_experts=6, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, rms_norm_eps=1e-5)
CONFIGS = {
    # the released models' pattern: sliding, full, sliding; a window of 10 under every
    # prompt; YaRN untruncated; a SwiGLU limit the gate and up products cross
    "main": dict(sliding_window=10, rope_parameters=YARN, swiglu_limit=1.5),
    # every layer sliding, YaRN with the truncated ramp, no attention biases, tied
    # embeddings, GQA 4
    "variant": dict(sliding_window=6, num_attention_heads=8, head_dim=8,
                    layer_types=["sliding_attention"] * 3, attention_bias=False,
                    tie_word_embeddings=True, swiglu_limit=3.0,
                    rope_parameters={**YARN, "truncate": True, "factor": 8.0}),
}


def _make(kind: str, path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**{**BASE, **CONFIGS[kind]}))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("sinks"):  # a share of each softmax worth its name
                p.normal_(1.5, 1.5)
            else:
                p.normal_(0, 0.15)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(14, 36, (n,), generator=g).tolist()
    return [torch.randint(0, BASE["vocab_size"], (k,), generator=g).tolist() for k in lens]


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gptoss-{request.param}")
    return request.param, path, _make(request.param, path)


def test_greedy_and_logprobs_match_transformers(tiny):
    kind, path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=f"gpt-oss {kind}")


def test_the_features_change_the_answer(tiny):
    """The sinks, the windows and the SwiGLU clamp of the main config each move
    transformers' own logits, so the match above covers them."""
    kind, _, hf_model = tiny
    if kind != "main":
        pytest.skip("one config is enough")
    ids = torch.tensor([_prompts(1, seed=3)[0]])
    layers, config = hf_model.model.layers, hf_model.config

    def moved() -> float:
        return float((hf_model(input_ids=ids).logits - base).abs().max())

    with torch.no_grad():
        base = hf_model(input_ids=ids).logits
        sinks = [layer.self_attn.sinks.clone() for layer in layers]
        for layer in layers:
            layer.self_attn.sinks.fill_(-1e4)  # no share left for the sink
        changes = {"sinks": moved()}
        for layer, saved in zip(layers, sinks):
            layer.self_attn.sinks.copy_(saved)
        kinds, config.layer_types = config.layer_types, ["full_attention"] * 3
        changes["window"] = moved()
        config.layer_types = kinds
        for layer in layers:
            layer.mlp.experts.limit = 1e4
        changes["limit"] = moved()
        for layer in layers:
            layer.mlp.experts.limit = CONFIGS["main"]["swiglu_limit"]
        assert moved() < 1e-5  # all put back
    assert all(change > 0.1 for change in changes.values()), changes


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens."""
    kind, path, _ = tiny
    if kind != "main":
        pytest.skip("one config covers the schedule")
    prompts = _prompts(5, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = _llm(path)
    alone = [base.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = _llm(path, block_size=4, num_blocks=20, max_model_len=56,
                 max_num_batched_tokens=7)
    together = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert together == alone
    assert small.engine.engine_core.scheduler.num_preemptions_total > 0


def test_routing_picks_transformers_experts_at_rounding_ties():
    """Logits 1e-8 apart have one softmax probability in float32: the experts are chosen
    on the logits, as transformers' router chooses them."""
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    logits = torch.tensor([[1e-8, 0.0, -1.0, -2.0], [0.0, -3.0, 1e-8, -2.0],
                           [-3.0, 0.0, -1.0, 1e-8]])
    for top_k in (1, 2):
        router = GptOssTopKRouter(tf.GptOssConfig(hidden_size=8, num_local_experts=4,
                                                  num_experts_per_tok=top_k))
        with torch.no_grad():
            router.weight.zero_()
        x = torch.randn(3, 8)
        weights, ids = select_experts(logits, top_k, True, "topk_softmax")
        for row in range(3):
            with torch.no_grad():
                router.bias.copy_(logits[row])
            _, hf_weights, hf_ids = router(x[row:row + 1])
            assert ids[row].tolist() == hf_ids[0].tolist()
            torch.testing.assert_close(weights[row], hf_weights[0])


def test_config_reading_and_refusals():
    base = dict(BASE, architectures=[ARCH], model_type="gpt_oss")
    cfg = GptOssConfig.from_hf(base, ARCH)  # transformers' defaults for what is left out
    assert cfg.layer_windows == (128, None, 128)
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 32.0
    assert cfg.attention_bias and cfg.swiglu_limit == 7.0 and cfg.swiglu_alpha == 1.702
    # the released config.json: legacy rope_scaling beside rope_theta, keys transformers
    # does not read (experts_per_token, initial_context_length)
    released = dict(base, rope_theta=150000, experts_per_token=2, initial_context_length=4096,
                    sliding_window=128, rope_scaling={
                        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                        "original_max_position_embeddings": 4096, "rope_type": "yarn",
                        "truncate": False})
    cfg = GptOssConfig.from_hf(released, ARCH)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["truncate"] is False
    with pytest.raises(ConfigError, match="sliding_window"):
        GptOssConfig.from_hf({**base, "sliding_window": None}, ARCH)
    with pytest.raises(ConfigError, match="layer_types"):
        GptOssConfig.from_hf({**base, "layer_types": ["chunked_attention"] * 3}, ARCH)
    with pytest.raises(ConfigError, match="rope_type"):
        GptOssConfig.from_hf({**base, "rope_parameters": {"rope_type": "mrope"}}, ARCH)
    with pytest.raises(ConfigError, match="swiglu_limit"):
        GptOssConfig.from_hf({**base, "swiglu_limit": 0.0}, ARCH)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        GptOssForCausalLM(GptOssConfig.from_hf({**base, "num_experts_per_tok": 7}, ARCH))


def _mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [..., G, 16] and scales [..., G] of w [..., G * 32]: per group of 32 the
    power of two that brings its largest value to at most 6, each value rounded to the
    nearest FP4 e2m1 value (the test's own encoder; transformers decodes the bytes)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    index = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)
    nibble = (index + 8 * (scaled < 0)).to(torch.uint8)
    blocks = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def test_mxfp4_experts_are_dequantized_at_load(tiny, tmp_path, capfd):
    """The released checkpoints' layout: each expert tensor as MXFP4 blocks and scales
    (blocks along the input features), dense everything else; against transformers
    running its own decoding of the same bytes."""
    import copy

    import safetensors.torch as st
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    kind, path, hf_model = tiny
    if kind != "main":
        pytest.skip("one config covers the format")
    tensors = st.load_file(str(path / "model.safetensors"))
    oracle = copy.deepcopy(hf_model)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        dense = tensors.pop(name)  # [E, in, out]
        blocks, scales = _mxfp4_encode(dense.transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert decoded.shape == dense.shape
        oracle.get_parameter(name).data.copy_(decoded)
    st.save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = _prompts(3, seed=6)
    outs = _llm(tmp_path).generate(prompts, GREEDY)
    assert "MXFP4 experts: 6 tensor(s) dequantized to float32" in capfd.readouterr().err
    assert_outputs_match(outs, oracle, prompts, min_tokens=3 * 16, label="gpt-oss mxfp4")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    st.save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match=r"without their other half.*layers\.1\.mlp\.experts"):
        _llm(tmp_path)


def test_missing_sinks_and_expert_biases_are_refused_by_name(tiny, tmp_path):
    import safetensors.torch as st

    kind, path, _ = tiny
    if kind != "main":
        pytest.skip("one config covers the loader")
    tensors = st.load_file(str(path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    for gone, match in (("model.layers.1.self_attn.sinks", r"layers\.1\.self_attn\.sinks"),
                        ("model.layers.2.mlp.experts.down_proj_bias",
                         r"layers\.2\.mlp\.experts\.down_proj_bias")):
        st.save_file({k: v for k, v in tensors.items() if k != gone},
                     str(tmp_path / "model.safetensors"))
        with pytest.raises(Exception, match=match):
            _llm(tmp_path)
