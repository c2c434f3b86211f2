"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet layers beside gated full attention)
against transformers on tiny random weights in float32: through ``LLM`` (prompts longer
than a prefill chunk, a 16-request batch of mixed lengths under preemption), the sigmoid
output gate driven step by step (``hybrid_harness``), and the config reading, per-layer
cache specs and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from hf_oracle import assert_outputs_match
from models.hybrid_harness import assert_matches_transformers, build

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.core.cache_spec import PagedKVSpec, RecurrentStateSpec
from vllmpy.layers.gated_deltanet import GatedDeltaNet
from vllmpy.models.qwen3_next import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3NextConfig

VOCAB = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
# 4 layers, three linear to one full (transformers' default interval)
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)
# Qwen3.5's M-RoPE sections (text positions make it plain rotary), half of each head rotating
MROPE = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2],
                              "mrope_interleaved": True})

# variant -> (transformers class, its config class, config kwargs)
VARIANTS: dict[str, tuple[str, str, dict]] = {
    # a dense MLP on layer 1 (mlp_only_layers), MoE on the rest, a quarter of each head
    # rotating (the family's default)
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        BASE, **MOE, intermediate_size=96, mlp_only_layers=[1])),
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        BASE, **MROPE, intermediate_size=96, tie_word_embeddings=True)),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(
        BASE, **MOE, layer_types=["linear_attention", "full_attention", "linear_attention",
                                  "full_attention"])),
}
CONFIGS = {"Qwen3NextForCausalLM": Qwen3NextConfig, "Qwen3_5ForCausalLM": Qwen3_5Config,
           "Qwen3_5MoeForCausalLM": Qwen3_5MoeConfig}


def _make(variant: str, path, **extra) -> torch.nn.Module:
    import transformers as tf

    model_cls, config_cls, kwargs = VARIANTS[variant]
    torch.manual_seed(0)
    model = getattr(tf, model_cls)(getattr(tf, config_cls)(**kwargs, **extra))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the gated norm: w * norm(x)
                p.normal_(1.0, 0.1)
            elif "norm" in name:  # zero-centred: (1 + w) * norm(x)
                p.normal_(0.0, 0.1)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0, 0.15)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (1, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(*lengths, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lens]


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is as fast, and spares OpenMP's waits on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _make(request.param, path)


def test_llm_matches_transformers(tiny):
    """A 45-token prompt in 16-token prefill chunks beside shorter ones (one of a single
    token): greedy tokens and top-5 log-probs."""
    variant, path, hf_model = tiny
    prompts = _prompts(3, 2, (1, 20)) + _prompts(1, 4, (45, 46))
    prompts[0] = prompts[0][:1]
    outs = _llm(path, max_num_batched_tokens=16).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=variant)


def test_batch_of_16_chunked_and_preempted(tiny):
    """16 prompts of 1 to 59 tokens in 24-token steps with too few KV blocks for all of
    them: requests are preempted (their states recomputed from the first token) and every
    request's tokens and log-probs are still transformers'."""
    variant, path, hf_model = tiny
    prompts = _prompts(16, 3, (1, 60))
    llm = _llm(path, block_size=4, num_blocks=40, max_model_len=96,
               max_num_batched_tokens=24)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.engine_core.scheduler.num_preemptions_total > 0
    assert_outputs_match(outs, hf_model, prompts, min_tokens=16 * 16, label=variant)


def test_triton_path_matches_transformers(tiny):
    """The linear layers' device path (the convolution and delta-rule kernels, the decode
    kernel on decode-only steps), run by Triton's interpreter where there is no GPU, the
    rest of the model native: transformers' tokens and log-probs."""
    variant, path, hf_model = tiny
    model = build(path, num_seats=3)
    linear = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    for layer in linear:
        layer.bind_device(torch.device("cuda"))  # picks the kernels; tensors stay put
    assert linear and all(layer.on_cuda for layer in linear)
    assert_matches_transformers(model, hf_model, _prompts(2, 6, (5, 12)), 8, min_tokens=8)


def test_sigmoid_output_gate_matches_transformers(tmp_path):
    """``output_gate_type: sigmoid``: transformers' gated norm with its activation set to
    sigmoid, driven step by step (chunked prefills beside decodes)."""
    hf_model = _make("qwen3_5", tmp_path, output_gate_type="sigmoid")
    for layer in hf_model.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.norm.activation = "sigmoid"
    assert json.loads((tmp_path / "config.json").read_text())["output_gate_type"] == "sigmoid"
    model = build(tmp_path, num_seats=3)
    linear = [m for m in model.modules() if hasattr(m, "bind_state")]
    assert len(linear) == 3 and all(m.norm.act is torch.sigmoid for m in linear)
    assert_matches_transformers(model, hf_model, _prompts(3, 5), 24, min_tokens=3 * 12)


def test_mtp_tensors_are_left_to_the_proposer(tmp_path):
    """A checkpoint carrying its multi-token-prediction head (``mtp.*``) loads: those
    tensors are not the target model's (an unknown tensor would be refused by name)."""
    import safetensors.torch as st

    _make("qwen3_next", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = st.load_file(str(file))
    st.save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128),
                  "mtp.layers.0.input_layernorm.weight": torch.zeros(64)}, str(file))
    build(tmp_path, num_seats=1)
    st.save_file({**tensors, "model.mtp_fc.weight": torch.zeros(64, 128)}, str(file))
    with pytest.raises(ValueError, match="'model.mtp_fc.weight' has no matching"):
        build(tmp_path, num_seats=1)


def _read(variant: str, **changes):
    arch, _, kwargs = VARIANTS[variant]
    cfg = {**kwargs, "architectures": [arch], **changes}
    return CONFIGS[arch].from_hf({k: v for k, v in cfg.items() if v is not None}, arch)


def test_cache_specs_are_the_built_models_in_order(tmp_path):
    """The config's specs are the caching modules' of the built model, in model order:
    the Gated DeltaNet states [conv_dim, K - 1] and [Hv, dk, dv], paged K/V on the full
    layers."""
    _make("qwen3_5_moe", tmp_path)
    model = build(tmp_path, num_seats=2)  # checks the modules against the specs
    text = _read("qwen3_5_moe")
    specs = text.layer_cache_specs()
    assert list(specs) == [m.cache_spec() for m in model.modules() if hasattr(m, "cache_spec")]
    assert [type(s) for s in specs] == [RecurrentStateSpec, PagedKVSpec] * 2
    linear = specs[0]
    assert isinstance(linear, RecurrentStateSpec) and linear.kind == "gated_deltanet"
    assert [(t.name, t.shape, t.dtype_role) for t in linear.tensors] == [
        ("conv", (2 * 2 * 16 + 4 * 8, 3), "model"), ("ssm", (4, 16, 8), "ssm")]
    assert specs[1] == PagedKVSpec(2, 16, None)


def test_config_reading():
    nxt = _read("qwen3_next")
    assert nxt.layer_kinds == ("linear_attention",) * 3 + ("full_attention",)
    assert nxt.sparse_layers == (True, False, True, True) and nxt.norm_topk_prob
    assert (nxt.rotary_dim, nxt.output_gate_type, nxt.projections) == (4, "silu",
                                                                       "qkvz_grouped")
    dense = _read("qwen3_5")
    assert dense.rotary_dim == 8 and dense.rope_scaling is None  # M-RoPE read as plain
    assert dense.sparse_layers == (False,) * 4 and dense.projections == "qkv_z_b_a"
    moe = _read("qwen3_5_moe", norm_topk_prob=False)  # this family always renormalises
    assert moe.sparse_layers == (True,) * 4 and moe.norm_topk_prob
    # without layer_types: every full_attention_interval-th layer is a full one
    spaced = _read("qwen3_next", num_hidden_layers=6, mlp_only_layers=[],
                   full_attention_interval=2)
    assert spaced.layer_kinds == ("linear_attention", "full_attention") * 3
    # a multimodal wrapper's config: the text model under text_config
    _, _, kwargs = VARIANTS["qwen3_5"]
    nested = Qwen3_5Config.from_hf({"architectures": ["Qwen3_5ForCausalLM"],
                                    "model_type": "qwen3_5", "text_config": kwargs},
                                   "Qwen3_5ForCausalLM")
    assert nested.layer_kinds == dense.layer_kinds and nested.hidden_size == 64
    assert nested.tie_word_embeddings
    for value, gate in (("silu", "silu"), ("swish", "silu"), ("sigmoid", "sigmoid")):
        assert _read("qwen3_5", output_gate_type=value).output_gate_type == gate


@pytest.mark.parametrize("value", ["gelu", "", 1, "SiLU"])
def test_output_gate_type_refused_by_name(value):
    with pytest.raises(ConfigError, match=f"'output_gate_type'={value!r} is not supported"):
        _read("qwen3_5", output_gate_type=value)


def test_output_gate_type_null_is_a_value_not_an_absence():
    arch, _, kwargs = VARIANTS["qwen3_5_moe"]
    with pytest.raises(ConfigError, match="'output_gate_type'=None is not supported"):
        Qwen3_5MoeConfig.from_hf({**kwargs, "architectures": [arch],
                                  "output_gate_type": None}, arch)
    nested = {"architectures": [arch], "text_config": {**kwargs, "output_gate_type": "relu"}}
    with pytest.raises(ConfigError, match="'output_gate_type'='relu'"):
        Qwen3_5MoeConfig.from_hf(nested, arch)


@pytest.mark.parametrize("changes,match", [
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                       "full_attention"]), "'layer_types' entry 'sliding_attention'"),
    (dict(layer_types=["full_attention"]), "one kind per layer"),
    (dict(attn_output_gate=False), "'attn_output_gate'=False"),
    (dict(hidden_act="gelu"), "'hidden_act'='gelu'"),
    (dict(linear_num_value_heads=3), "'linear_num_value_heads'=3"),
    (dict(linear_conv_kernel_dim=1), "'linear_conv_kernel_dim'=1"),
    (dict(num_experts_per_tok=5), "'num_experts_per_tok'=5"),
    (dict(shared_expert_intermediate_size=0), "'shared_expert_intermediate_size'=0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.1}), "'partial_rotary_factor'=0.1"),
])
def test_refusals_name_key_and_value(changes, match):
    with pytest.raises(ConfigError, match=match):
        _read("qwen3_next", **changes)
