"""--speculative-config: vLLM's JSON parsed, defaulted and refused by name."""

from __future__ import annotations

import pytest

from vllmpy.config import ConfigError
from vllmpy.spec_decode.config import SpeculativeConfig


def test_ngram_defaults_follow_vllm():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min,
            c.prompt_lookup_max) == ("ngram", 3, 5, 5)
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


def test_method_is_inferred_from_the_model():
    c = SpeculativeConfig.from_json({"model": "draft.gguf", "num_speculative_tokens": 4})
    assert c.method == "draft_model" and c.model == "draft.gguf"
    for name, method in (("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
                         ("yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle")):
        c = SpeculativeConfig.from_json({"model": name, "num_speculative_tokens": 4})
        assert c.method == method


@pytest.mark.parametrize("value, needle", [
    ("{not json", "malformed JSON"),
    ("[1]", "must be a JSON object"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown field 'bogus'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min=5 must be <= prompt_lookup_max=3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "m"}, "takes no model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "applies to method 'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "random"},
     "only 'greedy' is accepted"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
      "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size 2"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa' is not supported yet"),
    ({"method": "suffix", "num_speculative_tokens": 1}, "'suffix' is not supported yet"),
    ({"method": "magic", "num_speculative_tokens": 2}, "unknown method 'magic'"),
    ({"num_speculative_tokens": 2}, "name a method"),
])
def test_refusals_name_what_is_wrong(value, needle):
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        SpeculativeConfig.from_json(value)
    assert needle in str(e.value)


def _model_dir(path, **overrides):
    import json

    from server_utils import TINY_LLAMA

    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(TINY_LLAMA, **overrides)))
    return str(path)


def test_the_pool_counts_the_draft_models_layers_and_its_vocabulary_is_checked(tmp_path):
    from vllmpy.config import EngineArgs
    from vllmpy.engine.configure import build_engine_config

    target = _model_dir(tmp_path / "target")
    draft = _model_dir(tmp_path / "draft", num_hidden_layers=1)
    common = dict(model=target, load_format="dummy", device="cpu", dtype="float32",
                  num_blocks=64)
    plain = build_engine_config(EngineArgs(**common))
    spec = build_engine_config(EngineArgs(**common, speculative_config={
        "model": draft, "num_speculative_tokens": 2}))
    # TINY_LLAMA: 2 layers; the draft 1 of the same KV geometry.
    assert spec.cache.bytes_per_block == plain.cache.bytes_per_block * 3 // 2
    assert spec.speculative.method == "draft_model" and not spec.async_scheduling
    other = _model_dir(tmp_path / "other", vocab_size=1000)
    with pytest.raises(ConfigError, match="vocabulary of 1000 tokens, the target 49152"):
        build_engine_config(EngineArgs(**common, speculative_config={
            "model": other, "num_speculative_tokens": 2}))
