"""The checkpoint quantization tool (vllmpy.tools.quantize) against independent oracles.

Two tiny random models are quantized in every format: a Llama (bf16, untied lm_head) and a
Qwen3 (fp32, tied embeddings, q/k norms); hidden size 64, 2 layers, vocabulary 256. For
each, the written safetensors header must hold exactly the published tensor names, dtypes
and shapes (tabulated here from the formats' documentation), the untouched tensors must be
bit-identical to the source, and the config must be the published one.

Which oracle checks each format's values:

* every format: the NumPy dequantizers of ``quant/oracles.py`` (a hand-written safetensors
  reader, e4m3/bf16 decoded from their bit layouts, nibbles unpacked with NumPy), whose
  weights must lie within the quantization error of the source: for e4m3 half a unit in
  the last place (|w|/16, or scale * 2^-10 among subnormals), for int4 half a grid step
  (scale/2, plus the rounding of the stored scale);
* ct-fp8 and ct-w4a16 (symmetric and asymmetric): also transformers with compressed-tensors
  (``CompressedTensorsConfig(dequantize=True)``, which decompresses on the CPU), whose
  weights and logits must match the oracle-dequantized model;
* fp8-block: also transformers' FineGrainedFP8 (``FineGrainedFP8Config(dequantize=True)``,
  its CPU path), where the block size divides both weight dimensions (transformers derives
  the block from the scale grid, so partial edge blocks are checked by the oracle only);
* fp8-tensor, modelopt-fp8, awq, gptq: the oracle only (transformers loads none of them on
  the CPU); static input scales against a calibration pass measured here with hooks;
* the AWQ, GPTQ and compressed-tensors nibble orders: also known-answer words.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from quant import oracles

from vllmpy.tools import quantize as qt

GROUP = 32

# name -> (format, options); the tiny models' layers have K in {64, 128}, N in {32 .. 256}.
VARIANTS = {
    "fp8-tensor": ("fp8-tensor", {}),
    "fp8-tensor-static": ("fp8-tensor", {"activation_scheme": "static"}),
    "fp8-block": ("fp8-block", {}),
    "fp8-block-32": ("fp8-block", {"block_size": 32}),
    "fp8-block-48": ("fp8-block", {"block_size": 48}),
    "ct-fp8": ("ct-fp8", {}),
    "modelopt-fp8": ("modelopt-fp8", {}),
    "awq": ("awq", {"group_size": GROUP}),
    "gptq-sym": ("gptq", {"group_size": GROUP}),
    "gptq-asym": ("gptq", {"group_size": GROUP, "sym": False}),
    "gptq-desc-act": ("gptq", {"group_size": GROUP, "sym": False, "desc_act": True}),
    "ct-w4a16-sym": ("ct-w4a16", {"group_size": GROUP}),
    "ct-w4a16-asym": ("ct-w4a16", {"group_size": GROUP, "sym": False}),
}
MODELS = ("llama", "qwen3")
TRANSFORMERS_LOADABLE = ("ct-fp8", "ct-w4a16-sym", "ct-w4a16-asym", "fp8-block", "fp8-block-32")


def _tiny_config(kind: str):
    import transformers as tf

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                  max_position_embeddings=128)
    if kind == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False)
    return tf.Qwen3Config(**common, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """kind -> the source model directory (with a tokenizer_config.json to copy)."""
    import transformers as tf

    out = {}
    for kind, dtype in (("llama", torch.bfloat16), ("qwen3", torch.float32)):
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(_tiny_config(kind)).to(dtype)
        directory = tmp_path_factory.mktemp(f"src-{kind}")
        model.save_pretrained(directory)
        (directory / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
        out[kind] = directory
    return out


@pytest.fixture(scope="module")
def quantized(sources, tmp_path_factory):
    """quantized(kind, variant) -> the quantized directory, written once per module."""
    cache = {}

    def get(kind: str, variant: str):
        if (kind, variant) not in cache:
            fmt, options = VARIANTS[variant]
            dst = tmp_path_factory.mktemp(f"{kind}-{variant}")
            cache[kind, variant] = qt.quantize_checkpoint(sources[kind], dst, fmt, **options)
        return cache[kind, variant]
    return get


# ---- what each format must contain ------------------------------------------------------


def _expected_layer(variant: str, n: int, k: int, source_dtype: str) -> dict:
    """The published tensors of one quantized linear layer [N, K]: suffix -> (dtype, shape)."""
    fmt, options = VARIANTS[variant]
    g = options.get("group_size")
    if fmt == "fp8-tensor":
        out = {"weight": ("F8_E4M3", (n, k)), "weight_scale": ("F32", ())}
        if options.get("activation_scheme") == "static":
            out["input_scale"] = ("F32", ())
        return out
    if fmt == "fp8-block":
        b = options.get("block_size", 128)
        return {"weight": ("F8_E4M3", (n, k)),
                "weight_scale_inv": ("F32", (math.ceil(n / b), math.ceil(k / b)))}
    if fmt == "ct-fp8":
        return {"weight": ("F8_E4M3", (n, k)), "weight_scale": (source_dtype, (n, 1))}
    if fmt == "modelopt-fp8":
        return {"weight": ("F8_E4M3", (n, k)), "weight_scale": ("F32", ()),
                "input_scale": ("F32", ())}
    if fmt == "awq":
        return {"qweight": ("I32", (k, n // 8)), "qzeros": ("I32", (k // g, n // 8)),
                "scales": ("F16", (k // g, n))}
    if fmt == "gptq":
        return {"qweight": ("I32", (k // 8, n)), "qzeros": ("I32", (k // g, n // 8)),
                "scales": ("F16", (k // g, n)), "g_idx": ("I32", (k,))}
    out = {"weight_packed": ("I32", (n, k // 8)), "weight_scale": (source_dtype, (n, k // g)),
           "weight_shape": ("I64", (2,))}
    if options.get("sym") is False:
        out["weight_zero_point"] = ("I32", (n // 8, k // g))
    return out


def _ct_config(fmt: str, weights: dict, activations: dict | None, ignore: list) -> dict:
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations,
                                          "output_activations": None, "format": None}},
            "format": fmt, "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": None, "moe_sparsity_config": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.20.1"}


def _expected_config(variant: str) -> dict:
    fmt, options = VARIANTS[variant]
    sym = options.get("sym", True)
    if fmt == "fp8-tensor":
        return {"quant_method": "fp8", "ignored_layers": ["lm_head"],
                "activation_scheme": options.get("activation_scheme", "dynamic")}
    if fmt == "fp8-block":
        b = options.get("block_size", 128)
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [b, b]}
    if fmt == "ct-fp8":
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
        return _ct_config("float-quantized", {**fp8, "strategy": "channel", "dynamic": False},
                          {**fp8, "strategy": "token", "dynamic": True}, ["lm_head"])
    if fmt == "ct-w4a16":
        return _ct_config("pack-quantized",
                          {"num_bits": 4, "type": "int", "symmetric": sym, "group_size": GROUP,
                           "strategy": "group", "dynamic": False}, None, ["lm_head"])
    if fmt == "modelopt-fp8":
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        return {"config_groups": {"group_0": {"input_activations": fp8, "weights": fp8,
                                              "targets": ["Linear"]}},
                "ignore": ["lm_head"], "quant_algo": "FP8", "quant_method": "modelopt",
                "producer": {"name": "modelopt", "version": qt.MODELOPT_VERSION}}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
            "desc_act": options.get("desc_act", False), "sym": sym, "static_groups": False,
            "lm_head": False, "checkpoint_format": "gptq"}


def _is_quantized_linear(name: str, shape: tuple) -> bool:
    return (name.endswith("_proj.weight") and len(shape) == 2)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", MODELS)
def test_layout_names_dtypes_shapes_and_config(kind, variant, sources, quantized):
    src, dst = sources[kind], quantized(kind, variant)
    source = oracles.read_header(src / "model.safetensors")
    written = oracles.read_header(dst / "model.safetensors")
    expected = {}
    for name, (dtype, shape) in source.items():
        if _is_quantized_linear(name, shape):
            prefix = name.removesuffix(".weight")
            for suffix, entry in _expected_layer(variant, *shape, dtype).items():
                expected[f"{prefix}.{suffix}"] = entry
        else:
            expected[name] = (dtype, shape)
    assert written == expected
    assert ("lm_head.weight" in written) == (kind == "llama")

    source_values = oracles.read_tensors(src / "model.safetensors")
    written_values = oracles.read_tensors(dst / "model.safetensors")
    for name, array in source_values.items():
        if not _is_quantized_linear(name, array.shape):
            np.testing.assert_array_equal(written_values[name], array, err_msg=name)

    config = json.loads((dst / "config.json").read_text())
    source_config = json.loads((src / "config.json").read_text())
    assert config.pop("quantization_config") == _expected_config(variant)
    assert config == source_config
    assert (dst / "tokenizer_config.json").read_text() == \
        (src / "tokenizer_config.json").read_text()
    assert (dst / "generation_config.json").exists()
    assert sorted(p.name for p in dst.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"]
        + (["hf_quant_config.json"] if variant == "modelopt-fp8" else []))


def test_modelopt_hf_quant_config(quantized):
    hf_quant_config = json.loads((quantized("llama", "modelopt-fp8")
                                  / "hf_quant_config.json").read_text())
    assert hf_quant_config == {
        "producer": {"name": "modelopt", "version": qt.MODELOPT_VERSION},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                         "exclude_modules": ["lm_head"]}}


@pytest.mark.parametrize("variant", ["ct-fp8", "ct-w4a16-sym", "ct-w4a16-asym"])
def test_compressed_tensors_config_is_the_library_serialization(variant, quantized):
    """The config parses as compressed-tensors' QuantizationConfig and is what its
    ModelCompressor.update_config would write back for it."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    written = json.loads((quantized("llama", variant) / "config.json").read_text())
    written = written["quantization_config"]
    parsed = QuantizationConfig.model_validate(written)
    assert parsed.quantization_status == "compressed"
    assert written == {"version": ct.__version__, "quant_method": "compressed-tensors",
                       "sparsity_config": {}, "transform_config": {},
                       **parsed.model_dump(exclude=["quant_method"])}


# ---- values: the oracle against the source ----------------------------------------------

_UNIT_ROUNDOFF = {"F16": 2.0 ** -11, "BF16": 2.0 ** -8, "F32": 2.0 ** -24}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", MODELS)
def test_oracle_weights_within_quantization_error(kind, variant, sources, quantized):
    dst = quantized(kind, variant)
    fmt, config = oracles.checkpoint_format(dst), oracles.quantization_config(dst)
    source = oracles.read_tensors(sources[kind] / "model.safetensors")
    layers, _ = oracles.split_layers(dst)
    header = oracles.read_header(dst / "model.safetensors")
    assert sorted(f"{p}.weight" for p in layers) == sorted(
        name for name, array in source.items() if _is_quantized_linear(name, array.shape))
    is_fp8 = VARIANTS[variant][0] not in qt.INT4_FORMATS
    for prefix, parts in layers.items():
        w = source[f"{prefix}.weight"].astype(np.float32)
        deq = oracles.dequantize_layer(fmt, parts, config)
        scale = oracles.element_scales(fmt, parts, config)
        assert deq.shape == w.shape and np.isfinite(deq).all()
        error = np.abs(deq - w)
        if is_fp8:
            # half an e4m3 ulp: 2^-4 relative among normals, 2^-10 * scale among subnormals
            bound = np.maximum(np.abs(w) * 2.0 ** -4, scale * 2.0 ** -10)
        else:
            # half a grid step, plus up to ~16 roundings of the stored scale
            stored = next(header[f"{prefix}.{part}"][0] for part in ("scales", "weight_scale")
                          if f"{prefix}.{part}" in header)
            bound = scale * (0.5 + 16 * _UNIT_ROUNDOFF[stored])
        assert (error <= bound * (1 + 1e-6) + 1e-9).all(), \
            f"{prefix}: worst error / bound {(error / bound).max():.3f}"
        # the error is of the size the format allows, not much smaller (a sign that the
        # values were stored at all)
        assert error.max() > 0.05 * bound.max()


# ---- values: transformers against the oracle --------------------------------------------


# A quantization_config passed to from_pretrained only sets its loading attributes
# (dequantize); transformers warns that the checkpoint's config wins for the rest.
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize("variant", TRANSFORMERS_LOADABLE)
@pytest.mark.parametrize("kind", MODELS)
def test_transformers_loads_what_the_oracle_reads(kind, variant, sources, quantized):
    import transformers as tf

    dst = quantized(kind, variant)
    if variant.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
        quant_config = tf.CompressedTensorsConfig(dequantize=True)
    else:
        quant_config = tf.FineGrainedFP8Config(dequantize=True)
    model = tf.AutoModelForCausalLM.from_pretrained(dst, quantization_config=quant_config)
    dense = oracles.dequantize_checkpoint(dst)
    loaded = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    if kind == "qwen3":
        dense["lm_head.weight"] = dense["model.embed_tokens.weight"]
    assert sorted(loaded) == sorted(dense)
    for name, array in dense.items():
        # transformers keeps the model's dtype: bf16 rounds each product once more
        np.testing.assert_allclose(loaded[name], array, rtol=2.0 ** -7, atol=1e-7,
                                   err_msg=name)

    reference = tf.AutoModelForCausalLM.from_config(_tiny_config(kind)).to(model.dtype)
    reference.load_state_dict({name: torch.from_numpy(array).to(model.dtype)
                               for name, array in dense.items()})
    tokens = qt.calibration_tokens(256)[:2]
    with torch.no_grad():
        got = model(tokens).logits.float()
        want = reference(tokens).logits.float()
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())


# ---- static activation scales -----------------------------------------------------------


@pytest.mark.parametrize("variant", ["fp8-tensor-static", "modelopt-fp8"])
def test_static_input_scales_are_the_calibration_amax(variant, sources, quantized):
    """input_scale = the largest |input| each layer sees over the calibration tokens / 448,
    measured here with hooks on the source model."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(sources["llama"], dtype=torch.float32)
    seen: dict[str, float] = {}

    def hook(name):
        def record(module, args):
            seen[name] = max(seen.get(name, 0.0), args[0].abs().max().item())
        return record
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for row in qt.calibration_tokens(256):
            model(row[None])
    tensors = oracles.read_tensors(quantized("llama", variant) / "model.safetensors")
    scales = {name.removesuffix(".input_scale"): float(v)
              for name, v in tensors.items() if name.endswith(".input_scale")}
    assert sorted(scales) == sorted(seen)
    for name, amax in seen.items():
        assert scales[name] == pytest.approx(amax / 448, rel=1e-6), name
    # layers reading the same activations share a scale
    assert scales["model.layers.0.self_attn.q_proj"] == scales["model.layers.0.self_attn.v_proj"]


# ---- packing conventions ----------------------------------------------------------------


def test_nibble_orders_known_answers():
    """Codes 0..7 (and 8..15) of eight consecutive columns, packed into one int32 word: in
    order for GPTQ and compressed-tensors, AWQ's interleave [0, 2, 4, 6, 1, 3, 5, 7]."""
    codes = torch.arange(16).view(2, 8)
    sequential = qt._pack_int4(codes, qt.SEQUENTIAL_ORDER)
    awq = qt._pack_int4(codes, qt.AWQ_ORDER)
    as_int32 = np.array([0x76543210, 0xFEDCBA98 - 2**32, 0x75316420, 0xFDB9ECA8 - 2**32],
                        dtype=np.int32)
    assert sequential.dtype == awq.dtype == torch.int32
    assert sequential[:, 0].tolist() == as_int32[:2].tolist()
    assert awq[:, 0].tolist() == as_int32[2:].tolist()
    assert oracles.nibbles(as_int32[:2, None]).tolist() == codes.tolist()
    assert oracles._awq_unpack(as_int32[2:, None]).tolist() == codes.tolist()


def test_gptq_v1_zeros_are_stored_minus_one(quantized):
    for variant in ("gptq-sym", "gptq-asym", "gptq-desc-act"):
        layers, _ = oracles.split_layers(quantized("llama", variant))
        for parts in layers.values():
            fields = oracles.nibbles(parts["qzeros"])
            if variant == "gptq-sym":
                # zero 8 stored as 7 in every nibble
                assert (parts["qzeros"] == 0x77777777).all()
            else:
                # a stored 15 would read back as zero 16: v1 never stores it
                assert fields.max() <= 14 and len(np.unique(fields)) > 1
            k = parts["g_idx"].shape[0]
            in_order = np.arange(k) // GROUP
            if variant == "gptq-desc-act":
                assert not (parts["g_idx"] == in_order).all()
                assert (np.bincount(parts["g_idx"]) == GROUP).all()
            else:
                assert (parts["g_idx"] == in_order).all()


def test_quantizing_every_linear_layer(sources, tmp_path):
    """``ignore=()``: the untied lm_head is quantized too (gptq says so); a tied one is not
    stored, so a format that lists unquantized modules names it."""
    dst = qt.quantize_checkpoint(sources["llama"], tmp_path / "gptq", "gptq",
                                 group_size=GROUP, ignore=())
    header = oracles.read_header(dst / "model.safetensors")
    assert header["lm_head.qweight"] == ("I32", (64 // 8, 256))
    assert oracles.quantization_config(dst)["lm_head"] is True

    dst = qt.quantize_checkpoint(sources["qwen3"], tmp_path / "ct", "ct-w4a16",
                                 group_size=GROUP, ignore=())
    assert oracles.quantization_config(dst)["ignore"] == ["lm_head"]
    dst = qt.quantize_checkpoint(sources["llama"], tmp_path / "fp8", "fp8-tensor",
                                 ignore=("lm_head", "down_proj"))
    header = oracles.read_header(dst / "model.safetensors")
    assert header["model.layers.1.mlp.down_proj.weight"] == ("BF16", (64, 128))
    assert oracles.quantization_config(dst)["ignored_layers"] == ["lm_head", "down_proj"]


@pytest.mark.parametrize("fmt, options", [
    ("awq", {"sym": True}),
    ("awq", {"ignore": ()}),
    ("ct-fp8", {"activation_scheme": "static"}),
    ("fp8-block", {"activation_scheme": "static"}),
    ("modelopt-fp8", {"activation_scheme": "dynamic"}),
    ("gptq", {"activation_scheme": "dynamic"}),
    ("ct-w4a16", {"desc_act": True}),
    ("fp8-tensor", {"sym": False}),
    ("gptq", {"ignore": ("lm_head", "o_proj")}),
    ("gptq", {"group_size": 12}),
    ("int8", {}),
])
def test_refused_options(fmt, options):
    with pytest.raises(ValueError):
        qt.resolve_options(fmt, **options)


def test_group_size_must_divide_in_features(sources, tmp_path):
    with pytest.raises(ValueError, match="multiple of the group size"):
        qt.quantize_checkpoint(sources["llama"], tmp_path / "out", "awq", group_size=48)


def test_command_line(sources, tmp_path, capsys):
    dst = tmp_path / "cli"
    qt.main([str(sources["qwen3"]), str(dst), "--format", "gptq", "--group-size", "32",
             "--asym", "--desc-act"])
    assert f"wrote gptq checkpoint to {dst}" in capsys.readouterr().out
    config = oracles.quantization_config(dst)
    assert (config["sym"], config["desc_act"], config["group_size"]) == (False, True, 32)
    layers, _ = oracles.split_layers(dst)
    assert len(layers) == 14

    with pytest.raises(SystemExit) as refused:
        qt.main([str(sources["qwen3"]), str(tmp_path / "refused"), "--format", "awq", "--sym"])
    assert refused.value.code == 2
    assert "asymmetric" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
