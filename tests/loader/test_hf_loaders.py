"""Hugging Face directory loading: configs, safetensors, hub errors, dummy weights, stats.

The checkpoints are tiny random Llamas written by transformers; nothing here reaches the
Hugging Face Hub.
"""

from __future__ import annotations

import json
import os

import huggingface_hub
import pytest
import torch
from safetensors.torch import save_file

from vllmpy.loader import hub
from vllmpy.loader.dummy import dummy_weights
from vllmpy.loader.hf_config import (
    config_eos_ids,
    read_generation_eos,
    read_hf_config,
    resolve_torch_dtype,
)
from vllmpy.loader.hub import ModelNotFoundError, download_model, looks_like_repo_id
from vllmpy.loader.load_stats import LoadStats
from vllmpy.loader.safetensors_loader import iter_safetensors_weights, safetensors_files

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    return _tiny_llama()


@pytest.fixture(scope="module")
def single_file_dir(tmp_path_factory, tiny_llama) -> str:
    path = str(tmp_path_factory.mktemp("single"))
    tiny_llama.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, tiny_llama) -> str:
    path = str(tmp_path_factory.mktemp("sharded"))
    tiny_llama.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    return path


def _expected_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- safetensors


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_every_tensor_equals_state_dict(layout, single_file_dir, sharded_dir, tiny_llama):
    model_dir = single_file_dir if layout == "single" else sharded_dir
    files = safetensors_files(model_dir)
    if layout == "single":
        assert [os.path.basename(f) for f in files] == ["model.safetensors"]
    else:
        assert len(files) > 1
        assert os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json"))

    expected = _expected_state(tiny_llama)
    loaded = dict(iter_safetensors_weights(model_dir, torch.float32))
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name


def test_cast_to_requested_dtype(sharded_dir, tiny_llama):
    expected = _expected_state(tiny_llama)
    for dtype in (torch.bfloat16, torch.float16):
        loaded = dict(iter_safetensors_weights(sharded_dir, dtype))
        assert set(loaded) == set(expected)
        for name, tensor in loaded.items():
            assert tensor.dtype == dtype, name
            assert torch.equal(tensor, expected[name].to(dtype)), name


def test_no_safetensors_is_refused_naming_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no safetensors weights") as info:
        iter_safetensors_weights(tmp_path, torch.float32)
    assert str(tmp_path) in str(info.value)


def test_bin_only_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"\.bin checkpoints are not supported") as info:
        iter_safetensors_weights(tmp_path, torch.float32)
    assert str(tmp_path) in str(info.value)


def test_unlisted_safetensors_names_the_files(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "weights.safetensors"))
    with pytest.raises(ValueError, match="weights.safetensors"):
        iter_safetensors_weights(tmp_path, torch.float32)


def test_an_unsupported_dtype_is_refused_before_anything_is_yielded(tmp_path):
    save_file(
        {"a.weight": torch.zeros(2, 2), "b.index": torch.zeros(3, dtype=torch.float64)},
        str(tmp_path / "model.safetensors"),
    )
    # The refusal comes from the call itself, not from partway through iterating.
    with pytest.raises(ValueError, match=r"'b\.index'.*F64"):
        iter_safetensors_weights(tmp_path, torch.float32)


def test_quantized_dtypes_come_as_stored(tmp_path):
    """fp8 weights and packed int32 words belong to a quantized checkpoint: not cast (the
    layer's quantization method takes them, an unquantized layer refuses them)."""
    save_file({"a.weight": torch.zeros(2, 2, dtype=torch.bfloat16),
               "b.qweight": torch.zeros(3, dtype=torch.int32),
               "c.weight": torch.zeros(2, dtype=torch.float8_e4m3fn)},
              str(tmp_path / "model.safetensors"))
    dtypes = {n: t.dtype for n, t in iter_safetensors_weights(tmp_path, torch.float32)}
    assert dtypes == {"a.weight": torch.float32, "b.qweight": torch.int32,
                      "c.weight": torch.float8_e4m3fn}


def test_index_with_missing_shard_is_refused(tmp_path):
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors.*missing"):
        iter_safetensors_weights(tmp_path, torch.float32)


def test_malformed_index_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        iter_safetensors_weights(tmp_path, torch.float32)


# ---------------------------------------------------------------- configs


def test_read_hf_config(single_file_dir, tmp_path):
    config = read_hf_config(single_file_dir)
    assert config["hidden_size"] == 64
    assert config["architectures"] == ["LlamaForCausalLM"]

    with pytest.raises(ValueError, match="config.json") as info:
        read_hf_config(tmp_path)
    assert str(tmp_path) in str(info.value)

    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="could not be read as JSON"):
        read_hf_config(tmp_path)

    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected an object"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"eos_token_id": 7}', {7}),
        ('{"eos_token_id": [7, 9]}', {7, 9}),
        ('{"eos_token_id": null}', set()),
        ('{"bos_token_id": 1}', set()),
        ("{not json", set()),
        ("[7]", set()),
        (None, set()),  # no generation_config.json at all
    ],
)
def test_generation_eos(tmp_path, content, expected):
    if content is not None:
        (tmp_path / "generation_config.json").write_text(content)
    assert read_generation_eos(tmp_path) == expected


def test_eos_merging(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 5]}')
    merged = config_eos_ids({"eos_token_id": 2}) | read_generation_eos(tmp_path)
    assert merged == {2, 5}
    assert config_eos_ids({"eos_token_id": [3, 4]}) == {3, 4}
    assert config_eos_ids({"eos_token_id": None}) == set()
    assert config_eos_ids({}) == set()


def test_saved_generation_config_is_read(single_file_dir):
    # transformers writes generation_config.json from the model config's eos id.
    assert read_generation_eos(single_file_dir) == {2}


@pytest.mark.parametrize(
    ("config", "requested", "device", "expected"),
    [
        ({"torch_dtype": "bfloat16"}, "float32", "cuda", torch.float32),
        ({"torch_dtype": "float32"}, "float16", "cpu", torch.float16),
        ({}, "bfloat16", "cpu", torch.bfloat16),
        ({"torch_dtype": "bfloat16"}, "auto", "cuda", torch.bfloat16),
        ({"torch_dtype": "bfloat16"}, "auto", "cpu", torch.bfloat16),
        ({"torch_dtype": "float16"}, "auto", "cpu", torch.float16),
        ({"torch_dtype": "float32"}, "auto", "cuda", torch.float32),
        ({"dtype": "float16"}, "auto", "cuda", torch.float16),
        ({"text_config": {"torch_dtype": "bfloat16"}}, "auto", "cpu", torch.bfloat16),
        ({}, "auto", "cpu", torch.float32),
        ({}, "auto", "cuda", torch.bfloat16),
    ],
)
def test_resolve_torch_dtype(config, requested, device, expected):
    assert resolve_torch_dtype(config, requested, device_type=device) == expected


def test_resolve_torch_dtype_refusals():
    with pytest.raises(ValueError, match=r"'fp8'.*auto, float32, bfloat16, float16"):
        resolve_torch_dtype({}, "fp8")
    with pytest.raises(ValueError, match=r"'float64'.*--dtype"):
        resolve_torch_dtype({"torch_dtype": "float64"}, "auto")


# ---------------------------------------------------------------- hub


def test_download_model_offline_raises_model_not_found(tmp_path, monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE at import, so set its constant as well.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as info:
        download_model("some-org/no-such-model", revision="v1", download_dir=str(tmp_path))
    message = str(info.value)
    assert "'some-org/no-such-model'" in message
    assert "'v1'" in message
    assert "could not be reached" in message
    assert ".gguf" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "error",
    [
        huggingface_hub.errors.OfflineModeIsEnabled("offline"),
        ConnectionError("Name or service not known"),
        huggingface_hub.errors.LocalEntryNotFoundError("cannot find snapshot"),
    ],
)
def test_download_model_connection_errors(monkeypatch, error):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ModelNotFoundError, match="some-org/model.*default revision"):
        download_model("some-org/model")


def test_download_model_passes_patterns_and_dir(monkeypatch, tmp_path):
    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(hub.huggingface_hub, "snapshot_download", fake)
    assert download_model("org/name", revision="main", download_dir="/cache") == str(tmp_path)
    ((repo_id, kwargs),) = calls
    assert repo_id == "org/name"
    assert kwargs["revision"] == "main"
    assert kwargs["cache_dir"] == "/cache"
    for pattern in ("*.json", "*.safetensors"):
        assert pattern in kwargs["allow_patterns"]


def test_looks_like_repo_id(tmp_path):
    assert looks_like_repo_id("meta-llama/Llama-3.2-1B-Instruct")
    assert looks_like_repo_id("Qwen/Qwen2.5-0.5B")
    assert not looks_like_repo_id("llama")
    assert not looks_like_repo_id("a/b/c")
    assert not looks_like_repo_id("/abs/path")
    assert not looks_like_repo_id("./rel")
    assert not looks_like_repo_id("models/x.gguf")
    assert not looks_like_repo_id("../up")
    existing = tmp_path / "org" / "name"
    existing.mkdir(parents=True)
    assert not looks_like_repo_id(str(existing))


# ---------------------------------------------------------------- dummy weights


def test_dummy_weights_shapes_kinds_and_determinism():
    shapes = {
        "model.embed_tokens.weight": (torch.Size([256, 64]), torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": (torch.Size([64, 64]), torch.float32),
        "model.layers.0.self_attn.q_proj.bias": (torch.Size([64]), torch.float32),
        "model.layers.0.input_layernorm.weight": (torch.Size([64]), torch.float16),
        "model.norm.weight": (torch.Size([64]), torch.float32),
    }
    first = dict(dummy_weights(shapes, seed=0))
    again = dict(dummy_weights(shapes, seed=0))
    other = dict(dummy_weights(shapes, seed=1))
    assert list(first) == list(shapes)
    for name, (shape, dtype) in shapes.items():
        assert first[name].shape == shape and first[name].dtype == dtype, name
        assert torch.equal(first[name], again[name]), name

    q = first["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, other["model.layers.0.self_attn.q_proj.weight"])
    assert 0.01 < q.std().item() < 0.03
    assert torch.equal(first["model.norm.weight"], torch.ones(64))
    assert torch.equal(
        first["model.layers.0.input_layernorm.weight"], torch.ones(64, dtype=torch.float16)
    )
    assert torch.equal(first["model.layers.0.self_attn.q_proj.bias"], torch.zeros(64))

    # A tensor does not depend on what else is in the dict.
    q_name = "model.layers.0.self_attn.q_proj.weight"
    alone = dict(dummy_weights({q_name: shapes[q_name]}, seed=0))
    assert torch.equal(alone[q_name], q)


def test_dummy_weights_refuse_integer_dtype():
    with pytest.raises(ValueError, match="'ids'.*torch.int64"):
        list(dummy_weights({"ids": (torch.Size([4]), torch.int64)}))


# ---------------------------------------------------------------- load stats


def test_load_stats_prints_only_when_enabled(monkeypatch, capsys):
    stats = LoadStats()
    with stats.phase("config"):
        pass
    with stats.phase("weights"):
        pass
    with stats.phase("weights"):
        pass
    assert list(stats.seconds) == ["config", "weights"]

    monkeypatch.setenv("VT_LOAD_STATS", "0")
    stats.report()
    assert capsys.readouterr().err == ""

    monkeypatch.setenv("VT_LOAD_STATS", "1")
    stats.report()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[vllmpy load] config ")
    assert lines[1].startswith("[vllmpy load] weights          ")
    assert all(line.endswith(" s") for line in lines)


def test_load_stats_records_a_phase_that_raises():
    stats = LoadStats()
    with pytest.raises(RuntimeError), stats.phase("weights"):
        raise RuntimeError("boom")
    assert "weights" in stats.seconds
