"""RotaryEmbedding's scaling types, partial rotary and interleaved pairs against
transformers: cos/sin against the models' own rotary modules (``ROPE_INIT_FUNCTIONS``
behind them, on a config of the model's class), rotated q and k against the models'
``apply_rotary_pos_emb``; and what ``check_rope_scaling`` refuses."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import CohereConfig, GlmConfig, GPTNeoXConfig, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.cohere import modeling_cohere as cohere
from transformers.models.glm import modeling_glm as glm
from transformers.models.gpt_neox import modeling_gpt_neox as gpt_neox
from transformers.models.llama import modeling_llama as llama
from transformers.models.phi3 import modeling_phi3 as phi3

from vllmpy.layers.rotary import RotaryEmbedding, check_rope_scaling

CPU = torch.device("cpu")
MAX_POS = 1024
SHORT = [1.0 + 0.1 * i for i in range(12)]  # LongRoPE factors for 12 frequencies
LONG = [2.0 + 0.5 * i for i in range(12)]

# name -> (config class, rotary module, head_dim, rope_parameters, extra config fields)
CASES = {
    "default": (LlamaConfig, llama.LlamaRotaryEmbedding, 64,
                {"rope_type": "default", "rope_theta": 10000.0}, {}),
    "linear": (LlamaConfig, llama.LlamaRotaryEmbedding, 64,
               {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, {}),
    "dynamic": (LlamaConfig, llama.LlamaRotaryEmbedding, 64,
                {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, {}),
    "llama3": (LlamaConfig, llama.LlamaRotaryEmbedding, 128,
               {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                "rope_theta": 500000.0}, {}),
    "yarn": (LlamaConfig, llama.LlamaRotaryEmbedding, 64,
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
              "rope_theta": 1e6}, {}),
    "yarn-attention-factor-untruncated": (
        LlamaConfig, llama.LlamaRotaryEmbedding, 64,
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
         "attention_factor": 0.8, "beta_fast": 16, "beta_slow": 2, "truncate": False,
         "rope_theta": 10000.0}, {}),
    "yarn-mscale-all-dim": (
        LlamaConfig, llama.LlamaRotaryEmbedding, 64,
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
         "mscale": 1.0, "mscale_all_dim": 0.5, "rope_theta": 10000.0}, {}),
    # Phi-4-mini's layout: partial rotary 0.75, the original length outside the dict
    "longrope-partial": (Phi3Config, phi3.Phi3RotaryEmbedding, 32,
                         {"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                          "rope_theta": 10000.0},
                         {"original_max_position_embeddings": 256,
                          "partial_rotary_factor": 0.75}),
    "longrope-attention-factor": (
        Phi3Config, phi3.Phi3RotaryEmbedding, 24,
        {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
         "attention_factor": 1.3, "rope_theta": 10000.0},
        {"original_max_position_embeddings": 512}),
    "partial-default": (GPTNeoXConfig, gpt_neox.GPTNeoXRotaryEmbedding, 64,
                        {"rope_type": "default", "rope_theta": 10000.0},
                        {"rotary_pct": 0.25}),
}


def hf_config(name):
    """The transformers config of a case, and its rope parameters as transformers
    standardises them (``rope_theta``, ``partial_rotary_factor`` and the original length
    moved in): the dict a converter passes on."""
    cls, _, head_dim, rope, extra = CASES[name]
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = cls(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2,
                 head_dim=head_dim, max_position_embeddings=MAX_POS,
                 rope_parameters=dict(rope), **extra)
    return config, dict(config.rope_parameters)


def hf_cos_sin(name, positions):
    """The model's rotary module on these positions (all in one call, as a prefill):
    cos, sin [num_tokens, rotary_dim]."""
    config, _ = hf_config(name)
    cos, sin = CASES[name][1](config)(torch.zeros(1), positions[None])
    return cos[0], sin[0]


def ours(name, **kw):
    _, params = hf_config(name)
    return RotaryEmbedding(CASES[name][2], MAX_POS, params["rope_theta"], params, **kw)


def close(a, b, tol=1e-6):
    """Equal within tol, absolute and relative (one float32 rounding or so)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    excess = ((a - b).abs() - tol * (1 + b.abs())).max().item()
    assert excess <= 0, f"off by {excess} past the tolerance"


@pytest.mark.parametrize("name", sorted(CASES))
def test_cos_sin_cache_is_transformers_below_the_original_length(name):
    emb = ours(name)
    config, params = hf_config(name)
    original = params.get("original_max_position_embeddings", MAX_POS)
    positions = torch.arange(original)
    cos, sin = hf_cos_sin(name, positions)
    table = emb.cos_sin_cache(CPU)
    half = emb.rotary_dim // 2
    assert table.dtype == torch.float32 and table.shape == (MAX_POS, emb.rotary_dim)
    assert emb.rotary_dim == int(emb.head_dim * params.get("partial_rotary_factor", 1.0))
    close(table[:original, :half], cos[:, :half])  # transformers' halves repeat
    close(table[:original, half:], sin[:, :half])
    close(cos[:, half:], cos[:, :half])


@pytest.mark.parametrize("name", ["longrope-partial", "longrope-attention-factor"])
def test_longrope_rows_past_the_original_length_use_the_long_factors(name):
    """transformers switches to the long factors once a sequence passes the original
    length (its position of 256 onwards here): the rows from there on are its numbers."""
    emb = ours(name)
    original = hf_config(name)[1]["original_max_position_embeddings"]
    positions = torch.arange(original, MAX_POS)
    cos, sin = hf_cos_sin(name, positions)
    table, half = emb.cos_sin_cache(CPU), emb.rotary_dim // 2
    close(table[original:, :half], cos[:, :half])
    close(table[original:, half:], sin[:, :half])


def test_dynamic_uses_the_ntk_base_of_the_table_length_over_max_trained_positions():
    """vLLM's rule: one base for every row, transformers' dynamic NTK base for a sequence
    of max_position tokens when the model was trained on max_trained_positions."""
    trained = 512
    emb = RotaryEmbedding(64, MAX_POS, 10000.0, {"rope_type": "dynamic", "factor": 2.0,
                                                 "max_trained_positions": trained})
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64,
                         max_position_embeddings=trained,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                          "rope_theta": 10000.0})
    inv_freq, scale = ROPE_INIT_FUNCTIONS["dynamic"](config, CPU, seq_len=MAX_POS)
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    assert scale == 1.0
    close(emb.cos_sin_cache(CPU), torch.cat([freqs.cos(), freqs.sin()], dim=-1))
    plain = RotaryEmbedding(64, MAX_POS, 10000.0).cos_sin_cache(CPU)
    assert not torch.allclose(emb.cos_sin_cache(CPU)[-1], plain[-1])


def as_hf(x, n, head_dim):
    """[num_tokens, heads * head_dim] -> transformers' [1, heads, num_tokens, head_dim]."""
    return x.reshape(n, -1, head_dim).transpose(0, 1).unsqueeze(0)


def from_hf(x, n):
    return x[0].transpose(0, 1).reshape(n, -1)


def qk_inputs(n, heads, kv_heads, head_dim, dtype, seed=0):
    """q and k as the split of one qkv projection (strided views), as models pass them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q, k


# name -> (transformers' apply_rotary_pos_emb, the case whose rotary module feeds it,
#          is_neox_style, positions' upper bound)
ROTATIONS = {
    "yarn (Llama)": (llama.apply_rotary_pos_emb, "yarn", True, MAX_POS),
    "llama3 (Llama)": (llama.apply_rotary_pos_emb, "llama3", True, MAX_POS),
    "partial default (GPT-NeoX)": (gpt_neox.apply_rotary_pos_emb, "partial-default", True,
                                   MAX_POS),
    "partial longrope, short (Phi-3)": (phi3.apply_rotary_pos_emb, "longrope-partial", True,
                                        256),
}


def hf_rotate(apply, cos, sin, q, k, n, head_dim):
    q_hf, k_hf = apply(as_hf(q.float(), n, head_dim), as_hf(k.float(), n, head_dim),
                       cos[None], sin[None])
    return from_hf(q_hf, n), from_hf(k_hf, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ROTATIONS))
def test_rotated_q_and_k_are_transformers(name, dtype):
    apply, case, neox, upper = ROTATIONS[name]
    emb = ours(case, is_neox_style=neox)
    head_dim, n = emb.head_dim, 23
    positions = torch.randint(0, upper, (n,), generator=torch.Generator().manual_seed(1))
    q, k = qk_inputs(n, 6, 2, head_dim, dtype)
    cos, sin = hf_cos_sin(case, positions)
    q_ref, k_ref = hf_rotate(apply, cos, sin, q, k, n, head_dim)
    q_out, k_out = emb(positions, q, k)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # one rounding to bf16
    close(q_out.float(), q_ref.to(dtype).float(), tol)
    close(k_out.float(), k_ref.to(dtype).float(), tol)
    if emb.rotary_dim < head_dim:  # the pass-through dims come back untouched
        assert torch.equal(q_out.view(n, 6, -1)[..., emb.rotary_dim:],
                           q.reshape(n, 6, -1)[..., emb.rotary_dim:])
    # [num_tokens, heads, head_dim] in, the same shape out, the same numbers
    q3, k3 = emb(positions, q.reshape(n, 6, head_dim), k.reshape(n, 2, head_dim))
    assert q3.shape == (n, 6, head_dim) and k3.shape == (n, 2, head_dim)
    assert torch.equal(q3.reshape(n, -1), q_out) and torch.equal(k3.reshape(n, -1), k_out)


def test_partial_longrope_past_the_original_length_is_transformers():
    emb = ours("longrope-partial")
    n, head_dim = 9, emb.head_dim
    positions = torch.randint(256, MAX_POS, (n,), generator=torch.Generator().manual_seed(2))
    q, k = qk_inputs(n, 4, 4, head_dim, torch.float32)
    cos, sin = hf_cos_sin("longrope-partial", positions)
    q_ref, k_ref = hf_rotate(phi3.apply_rotary_pos_emb, cos, sin, q, k, n, head_dim)
    q_out, k_out = emb(positions, q, k)
    close(q_out, q_ref)
    close(k_out, k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_pairs_are_coheres(dtype):
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = CohereConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=MAX_POS,
                          rope_parameters={"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 10000.0})
    emb = RotaryEmbedding(64, MAX_POS, 10000.0, config.rope_parameters, is_neox_style=False)
    assert not emb.fusable
    n = 17
    positions = torch.randint(0, MAX_POS, (n,), generator=torch.Generator().manual_seed(3))
    q, k = qk_inputs(n, 4, 1, 64, dtype)
    cos, sin = cohere.CohereRotaryEmbedding(config)(torch.zeros(1), positions[None])
    close(emb.cos_sin_cache(CPU)[positions, :32], cos[0, :, 0::2])  # neighbours share
    close(emb.cos_sin_cache(CPU)[positions, 32:], sin[0, :, 0::2])
    q_ref, k_ref = hf_rotate(cohere.apply_rotary_pos_emb, cos[0], sin[0], q, k, n, 64)
    q_out, k_out = emb(positions, q, k)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    close(q_out.float(), q_ref.to(dtype).float(), tol)
    close(k_out.float(), k_ref.to(dtype).float(), tol)


def test_interleaved_partial_pairs_are_glms():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = GlmConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=64, partial_rotary_factor=0.5, max_position_embeddings=MAX_POS)
    emb = RotaryEmbedding(64, MAX_POS, config.rope_parameters["rope_theta"], None,
                          rotary_dim=32, is_neox_style=False)
    n = 11
    positions = torch.randint(0, MAX_POS, (n,), generator=torch.Generator().manual_seed(4))
    q, k = qk_inputs(n, 2, 1, 64, torch.float32)
    cos, sin = glm.GlmRotaryEmbedding(config)(torch.zeros(1), positions[None])
    q_ref, k_ref = hf_rotate(glm.apply_rotary_pos_emb, cos[0], sin[0], q, k, n, 64)
    q_out, k_out = emb(positions, q, k)
    close(q_out, q_ref)
    close(k_out, k_ref)


def test_legacy_and_current_spellings_give_one_table():
    legacy = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    current = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
               "rope_theta": 1e6}
    a, b = RotaryEmbedding(64, MAX_POS, 1e6, legacy), RotaryEmbedding(64, MAX_POS, 1e6, current)
    assert torch.equal(a.cos_sin_cache(CPU), b.cos_sin_cache(CPU))
    assert torch.equal(a.cos_sin_cache(CPU), ours("yarn").cos_sin_cache(CPU))


def test_fusable_only_for_whole_heads_in_halves():
    assert RotaryEmbedding(64, 128, 1e4, {"type": "yarn", "factor": 2.0,
                                          "original_max_position_embeddings": 64}).fusable
    assert not RotaryEmbedding(64, 128, 1e4, rotary_dim=32).fusable
    assert not RotaryEmbedding(64, 128, 1e4, is_neox_style=False).fusable


def test_tables_are_shared_by_layers_with_the_same_settings_only():
    def emb(**kw):
        args = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}} | kw
        return RotaryEmbedding(64, 256, 1e4, args.pop("rope_scaling"), **args)

    same = emb(), emb()
    assert same[0].cos_sin_cache(CPU) is same[1].cos_sin_cache(CPU)
    assert same[0].cpu_table(CPU) is same[1].cpu_table(CPU)
    others = [emb(rotary_dim=32), emb(is_neox_style=False),
              emb(rope_scaling={"rope_type": "linear", "factor": 3.0}), emb(rope_scaling=None)]
    for other in others:
        assert other.cos_sin_cache(CPU) is not same[0].cos_sin_cache(CPU)
        assert other.cpu_table(CPU) is not same[0].cpu_table(CPU)
    assert others[0].cos_sin_cache(CPU).shape == (256, 32)
    assert not torch.equal(others[2].cos_sin_cache(CPU), same[0].cos_sin_cache(CPU))


def test_bound_to_cuda_a_fusable_layer_takes_the_kernel_and_others_the_native_path():
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    positions = torch.tensor([0, 3, 7, 100, 255], device=device)
    q, k = (t.to(device) for t in qk_inputs(5, 2, 1, 16, torch.float32))
    for kw in ({}, {"rotary_dim": 8}, {"is_neox_style": False}):
        emb = RotaryEmbedding(16, 256, 1e4, **kw)
        native = emb(positions, q, k)
        emb.bind_device(torch.device("cuda"))  # without CUDA, Triton interprets the kernel
        bound = emb(positions, q, k)
        assert hasattr(emb, "_fused") == emb.fusable
        for a, b in zip(bound, native):
            close(a, b)


# ---- refusals --------------------------------------------------------------------------

@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "ntk", "factor": 2.0}, ["rope_scaling.rope_type='ntk'", "not supported",
                                           "yarn"]),
    ({"type": "mrope"}, ["rope_scaling.type='mrope'"]),
    ({"type": "yarn", "factor": 2.0}, ["'yarn'", "'original_max_position_embeddings'"]),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, ["'high_freq_factor'"]),
    ({"type": "longrope", "long_factor": [1.0], "original_max_position_embeddings": 4},
     ["'short_factor'"]),
    ({"rope_type": "linear", "factor": None}, ["'factor'"]),
    ({"rope_type": "linear", "factor": "2"}, ["rope_scaling.factor='2'", "positive number"]),
    ({"rope_type": "dynamic", "factor": -1.0}, ["rope_scaling.factor=-1.0"]),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096.5},
     ["original_max_position_embeddings=4096.5", "integer"]),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
      "truncate": "no"}, ["truncate='no'"]),
    ({"type": "longrope", "short_factor": [1.0, "x"], "long_factor": [1.0],
      "original_max_position_embeddings": 4}, ["short_factor=[1.0, 'x']"]),
    ({"rope_type": "dynamic", "alpha": 1000.0}, ["alpha=1000.0", "NTK-alpha"]),
    ({"rope_type": "default", "mrope_section": [16, 24, 24]}, ["mrope_section", "M-RoPE"]),
    ({"rope_type": "yarn", "type": "linear", "factor": 2.0}, ["rope_type='yarn'",
                                                             "type='linear'"]),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, ["high_freq_factor=4.0"]),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, ["partial_rotary_factor=1.5"]),
    ({"rope_type": None}, ["rope_scaling.rope_type=None", "name of a rope type"]),
    ("yarn", ["rope_scaling='yarn'", "dict"]),
])
def test_check_rope_scaling_names_the_key_and_the_value(scaling, words):
    for key in ("rope_scaling", "rope_parameters.full_attention"):
        with pytest.raises(ValueError) as info:
            check_rope_scaling(scaling, key)
        for word in words:
            assert word.replace("rope_scaling", key) in str(info.value)
    with pytest.raises(ValueError):  # the constructor refuses the same
        RotaryEmbedding(64, 128, 1e4, scaling)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_rope_scaling_takes_every_dict_the_layer_takes(name):
    _, params = hf_config(name)
    check_rope_scaling(params)  # transformers' own standardised spelling
    check_rope_scaling(CASES[name][3] | {"original_max_position_embeddings": 256}
                       if "longrope" in name else CASES[name][3])
    check_rope_scaling({"type": "su", "short_factor": SHORT, "long_factor": LONG,
                        "original_max_position_embeddings": 4096})
    check_rope_scaling(None)


@pytest.mark.parametrize("kw, scaling, words", [
    ({"rotary_dim": 80}, None, ["rotary_dim", "head_dim=64", "80"]),
    ({"rotary_dim": 31}, None, ["even", "31"]),
    ({"rotary_dim": 48}, {"rope_type": "default", "partial_rotary_factor": 0.5},
     ["rotary_dim=48", "partial_rotary_factor=0.5"]),
    ({}, {"rope_type": "default", "rope_theta": 500000.0}, ["rope_theta=500000.0",
                                                            "base=10000.0"]),
    ({}, {"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
          "original_max_position_embeddings": 64}, ["short_factor has 12", "needs 32"]),
])
def test_the_constructor_refuses_settings_that_do_not_fit_the_head(kw, scaling, words):
    with pytest.raises(ValueError) as info:
        RotaryEmbedding(64, 128, 10000.0, scaling, **kw)
    for word in words:
        assert word in str(info.value)
