"""The checkpoint's quantization declaration: each format chosen by its quant_method, and
everything the engine does not run refused at configuration with the key and value."""

from __future__ import annotations

import json

import pytest
import torch

from vllmpy.layers.linear import Linear, PackedLinear
from vllmpy.layers.quantization import QuantizationError, quantization_config
from vllmpy.layers.quantization.awq import AWQConfig
from vllmpy.layers.quantization.compressed_tensors import CompressedTensorsConfig
from vllmpy.layers.quantization.fp8 import Fp8Config, Fp8HeadMethod, Fp8LinearMethod
from vllmpy.layers.quantization.gguf import GGUFConfig
from vllmpy.layers.quantization.gptq import GPTQConfig
from vllmpy.layers.quantization.modelopt import ModelOptConfig

CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {
              "targets": ["Linear"],
              "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                          "symmetric": True, "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                    "symmetric": True, "dynamic": True}}},
          "ignore": ["lm_head"]}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}


def config(section: dict | None, requested: str | None = None):
    hf = {"architectures": ["LlamaForCausalLM"]}
    if section is not None:
        hf["quantization_config"] = section
    return quantization_config("hf_dir", hf, None, requested)


def test_each_quant_method_has_its_config():
    assert config(None) is None
    assert isinstance(config({"quant_method": "fp8"}), Fp8Config)
    assert isinstance(config(CT_FP8), CompressedTensorsConfig)
    assert isinstance(config({"quant_method": "awq", "bits": 4, "group_size": 128,
                              "zero_point": True, "version": "gemm"}), AWQConfig)
    assert isinstance(config(GPTQ), GPTQConfig)
    assert isinstance(config({"quant_method": "modelopt", "quant_algo": "FP8"}),
                      ModelOptConfig)
    assert isinstance(quantization_config("gguf", {}, None), GGUFConfig)


def test_hf_quant_config_json_declares_modelopt(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8",
                                                            "exclude_modules": ["lm_head"]}}))
    assert isinstance(quantization_config("hf_dir", {}, str(tmp_path)), ModelOptConfig)


@pytest.mark.parametrize("section,match", [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes': bitsandbytes"),
    ({"quant_method": "mxfp4", "group_size": 32}, r"mxfp4 keys \['group_size'\]"),
    ({"quant_method": "exl3"}, "'exl3': EXL3"),
    ({"quant_method": "marlin_v9"}, "'marlin_v9' is not supported; supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "weird"}, "activation_scheme='weird'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "dynamic activations only"),
    ({"quant_method": "fp8", "surprise": 1}, "key 'surprise'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "awq", "bits": 3}, "bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 256}, "group_size=256"),
    ({**GPTQ, "bits": 8}, "bits=8"),
    ({**GPTQ, "checkpoint_format": "gptq_v2"}, "checkpoint_format='gptq_v2'"),
    ({**GPTQ, "lm_head": True}, "lm_head=true"),
    ({**GPTQ, "group_size": 48}, "group_size=48"),
    ({**CT_FP8, "format": "marlin-24"}, "format='marlin-24'"),
    ({**CT_FP8, "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ({**CT_FP8, "config_groups": {"group_0": {
        **CT_FP8["config_groups"]["group_0"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     "weights.strategy='block'"),
    ({**CT_FP8, "config_groups": {"group_0": {
        **CT_FP8["config_groups"]["group_0"], "input_activations": None}}}, "W8A16"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo='NVFP4'"),
])
def test_what_the_engine_does_not_run_is_refused_by_name(section, match):
    with pytest.raises(QuantizationError, match=match):
        config(section)


def test_the_flag_must_agree_with_the_checkpoint():
    with pytest.raises(QuantizationError, match="--quantization awq does not match"):
        config(GPTQ, "awq")
    with pytest.raises(QuantizationError, match="only fp8 quantizes weights at load"):
        config(None, "gptq")
    with pytest.raises(QuantizationError, match="a GGUF file carries its own block types"):
        quantization_config("gguf", {}, None, "fp8")
    online = config(None, "fp8")
    assert isinstance(online, Fp8Config) and online.online


def test_layers_get_their_method_by_name():
    cfg = config({"quant_method": "fp8", "weight_block_size": [128, 128],
                  "ignored_layers": ["model.layers.0.mlp.down_proj"]})
    with torch.device("meta"):
        qkv = PackedLinear(256, {"q": 256, "k": 128, "v": 128})
        down = Linear(512, 256)
    method = cfg.linear_method("model.layers.0.self_attn.qkv_proj", qkv)
    assert isinstance(method, Fp8LinearMethod) and method.scheme == "block"
    assert cfg.linear_method("model.layers.0.mlp.down_proj", down).name == "dense"
    assert isinstance(cfg.linear_method("lm_head", down), Fp8HeadMethod)


def test_a_packed_layer_partly_ignored_is_refused():
    cfg = config({**CT_FP8, "ignore": ["model.layers.0.self_attn.q_proj"]})
    with torch.device("meta"):
        qkv = PackedLinear(256, {"q": 256, "k": 128, "v": 128})
    with pytest.raises(QuantizationError, match="some of its parts unquantized"):
        cfg.linear_method("model.layers.0.self_attn.qkv_proj", qkv)


def test_an_fp8_tensor_in_an_unquantized_checkpoint_is_refused(tmp_path):
    """A float8 weight with no quantization_config: copying it into a bf16 parameter would
    drop its scale; the load names the tensor instead."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from vllmpy import LLM

    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name}: the checkpoint stores torch.float8_e4m3fn"):
        LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", num_blocks=8)
