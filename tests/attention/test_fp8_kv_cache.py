"""The fp8 KV cache on the CPU: quantized writes, dequantized reads, per-layer scales from
the checkpoint, and a whole engine serving a tiny model on fp8 pages."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllmpy.attention.backend import TorchReferenceBackend, write_kv_cache
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.layers.attention import Attention, KVScaleLoader

FP8 = torch.float8_e4m3fn
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
            rms_norm_eps=1e-6)


def naive_causal(q, k, v, scale):
    """q [T, H, D], k/v [T, KH, D] of one whole sequence -> [T, H, D], in float32."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    t = q.shape[0]
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def fp8_round_trip(x, scale):
    """What an fp8 page gives back for x: e4m3(clamp(x / scale, +-448)) * scale, by torch."""
    return (x / scale).clamp(-448, 448).to(FP8).float() * scale


@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.02, 0.5)])
def test_backend_over_an_fp8_cache_attends_over_the_round_tripped_keys_and_values(
        k_scale, v_scale):
    """A prefill of 9 tokens, then a 1-token decode and a 4-token chunk on top of it: the
    output is exact attention over the fp8 round trip of every key and value."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    scale = 1 / math.sqrt(dim)
    n = 14
    q = torch.randn(n, heads, dim)
    k = torch.randn(n, kv_heads, dim) * 3
    v = torch.randn(n, kv_heads, dim)
    k[2, 0, 0] = 1e4  # far past 448 * k_scale: clamped, not inf or nan
    blocks = [5, 1, 7, 2]
    cache = torch.zeros(2, 8, bs, kv_heads, dim, dtype=FP8)
    backend = TorchReferenceBackend(heads, kv_heads, dim, scale)

    def step(start, end):
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start, end)])
        meta = AttentionMetadata(
            num_actual_tokens=end - start,
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            query_start_loc_cpu=[0, end - start],
            seq_lens=torch.tensor([end], dtype=torch.int32), seq_lens_cpu=[end],
            slot_mapping=slots, block_tables=torch.tensor([blocks], dtype=torch.int32),
            block_size=bs)
        return backend.forward(q[start:end], k[start:end], v[start:end], cache, meta,
                               k_scale, v_scale)

    outs = torch.cat([step(0, 9), step(9, 10), step(10, 14)])
    expected = naive_causal(q, fp8_round_trip(k, k_scale), fp8_round_trip(v, v_scale), scale)
    torch.testing.assert_close(outs, expected, atol=1e-5, rtol=1e-5)
    assert cache.float().abs().max() == 448  # the clamped key


def test_non_fp8_caches_ignore_the_scales():
    k = torch.randn(3, 2, 8)
    cache = torch.zeros(2, 1, 4, 2, 8)
    write_kv_cache(k, k, cache, torch.tensor([0, 1, 3]), k_scale=0.1, v_scale=7.0)
    torch.testing.assert_close(cache[0, 0, [0, 1, 3]], k, atol=0, rtol=0)


# ---- scales from the checkpoint ------------------------------------------------------------

def tiny_model(arch="LlamaForCausalLM"):
    from vllmpy.models.registry import resolve_model_class, text_config

    text = text_config({**TINY, "architectures": [arch]})
    return resolve_model_class([arch])(text)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_kv_scales_load_under_every_checkpoint_spelling(arch):
    model = tiny_model(arch)
    params = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    scales = [
        ("model.layers.0.self_attn.k_scale", 0.25),  # compressed-tensors
        ("model.layers.0.self_attn.v_scale", 0.5),
        ("model.layers.1.self_attn.k_proj.k_scale", 2.0),  # ModelOpt
        ("model.layers.1.self_attn.attn.v_scale", 3.0),  # vLLM's own name
    ]
    # checkpoints store a scale as a 0-d or a 1-element tensor
    weights = params + [(n, torch.tensor(s) if i % 2 else torch.tensor([s]))
                        for i, (n, s) in enumerate(scales)]
    loaded = model.load_weights(weights)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.25, 0.5), (2.0, 3.0)]
    assert {f"model.layers.{i}.self_attn.attn.{kind}" for i in (0, 1)
            for kind in ("k_scale", "v_scale")} <= loaded
    assert {name for name, _ in params} <= loaded


@pytest.mark.parametrize("name, value, error", [
    ("model.layers.7.self_attn.k_scale", torch.tensor(1.0), "names no attention layer"),
    ("lm_head.v_scale", torch.tensor(1.0), "names no attention layer"),
    ("model.layers.0.self_attn.k_scale", torch.ones(2), r"one positive finite .*shape \(2,\)"),
    ("model.layers.0.self_attn.v_scale", torch.tensor(0.0), "one positive finite .*value 0.0"),
    ("model.layers.0.self_attn.v_scale", torch.tensor(float("inf")), "value inf"),
])
def test_a_bad_kv_scale_is_refused_naming_the_tensor(name, value, error):
    loader = KVScaleLoader(tiny_model())
    with pytest.raises(ValueError, match=error) as e:
        list(loader.filter([(name, value)]))
    assert repr(name) in str(e.value)


# ---- a whole engine on fp8 pages -----------------------------------------------------------

def write_tiny_checkpoint(path, scales=None, quantization_config=None):
    """A tiny random Llama as transformers saves it, plus KV scale tensors and a
    quantization_config in config.json when given."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, tie_word_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.float().save_pretrained(path, safe_serialization=True)
    if scales:
        weights = load_file(str(path / "model.safetensors"))
        weights.update({n: torch.tensor(s, dtype=torch.float32) for n, s in scales.items()})
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


MODELOPT_FP8_KV = {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


def engine_layers(llm):
    runner = llm.engine.engine_core.model_runner
    return runner, [m for m in runner.model.modules() if isinstance(m, Attention)]


def test_a_checkpoint_declaring_fp8_kv_without_scales_serves_on_scale_one(tmp_path, capsys):
    from vllmpy import LLM, SamplingParams

    path = write_tiny_checkpoint(tmp_path, quantization_config=MODELOPT_FP8_KV)
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_blocks=8, block_size=16)
    assert llm.config.cache.kv_cache_dtype == FP8
    err = capsys.readouterr().err
    assert ("fp8 KV cache: the checkpoint ships no k_scale/v_scale tensors; every layer "
            "serves on scale 1.0") in err
    runner, layers = engine_layers(llm)
    assert all(kv.dtype == FP8 for kv in runner.kv_caches)
    assert [(a.k_scale, a.v_scale) for a in layers] == [(1.0, 1.0)] * 2
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(**GREEDY))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_checkpoint_scales_are_used_and_a_partial_set_is_reported(tmp_path, capsys):
    from vllmpy import LLM

    scales = {"model.layers.0.self_attn.k_scale": 0.125, "model.layers.0.self_attn.v_scale": 0.5,
              "model.layers.1.self_attn.k_scale": 0.25}
    path = write_tiny_checkpoint(tmp_path, scales, quantization_config=MODELOPT_FP8_KV)
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_blocks=8, block_size=16)
    _, layers = engine_layers(llm)
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.125, 0.5), (0.25, 1.0)]
    assert ("fp8 KV cache: the checkpoint ships no k_scale/v_scale for 1 of 2 attention "
            "layers; those serve on scale 1.0") in capsys.readouterr().err


def test_no_scales_line_when_every_layer_has_its_scales_or_the_cache_is_not_fp8(
        tmp_path, capsys):
    from vllmpy import LLM

    scales = {f"model.layers.{i}.self_attn.{kind}": 0.5 for i in (0, 1)
              for kind in ("k_scale", "v_scale")}
    path = write_tiny_checkpoint(tmp_path, scales)
    LLM(path, skip_tokenizer_init=True, device="cpu", num_blocks=8, kv_cache_dtype="fp8")
    LLM(path, skip_tokenizer_init=True, device="cpu", num_blocks=8)  # float32 pages
    assert "fp8 KV cache:" not in capsys.readouterr().err


def test_fp8_pool_holds_twice_the_tokens_and_tracks_a_float32_cache(tmp_path):
    """The same --kv-cache-memory: the fp8 pool is allocated with twice the tokens of the
    bfloat16 one in the same bytes, and greedy tokens start as those of a float32 cache."""
    from vllmpy import LLM, SamplingParams

    path = write_tiny_checkpoint(tmp_path)
    memory = 2 * 2 * 16 * 2 * 16 * 2 * 12  # twelve bfloat16 blocks of 16 tokens
    pools = {}
    for kv in ("bfloat16", "fp8"):
        llm = LLM(path, skip_tokenizer_init=True, device="cpu", block_size=16,
                  kv_cache_memory=memory, kv_cache_dtype=kv)
        runner, _ = engine_layers(llm)
        pools[kv] = (llm.config.cache.num_tokens,
                     sum(t.numel() * t.element_size() for t in runner.kv_caches))
    assert pools["bfloat16"] == (12 * 16, memory)
    assert pools["fp8"] == (24 * 16, memory)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 30, 9)]
    params = SamplingParams(**{**GREEDY, "max_tokens": 16})
    outs = {kv: [o.outputs[0].token_ids for o in LLM(
        path, skip_tokenizer_init=True, device="cpu", block_size=16, num_blocks=16,
        kv_cache_dtype=kv).generate(prompts, params)] for kv in ("float32", "fp8")}
    # random weights give near-flat distributions, so quantization noise flips a late token
    # now and then; the opening tokens, which every fp8 page already feeds, agree
    assert all(a[:2] == b[:2] for a, b in zip(outs["fp8"], outs["float32"]))
    assert outs["fp8"] != outs["float32"]  # the fp8 pages really were in the loop
