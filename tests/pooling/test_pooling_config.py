"""sentence-transformers module files and --pooler-config, read into a PoolingSpec; the
pooler's arithmetic against plain torch."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from vllmpy.config import ConfigError
from vllmpy.pooling.config import parse_pooler_config, pooling_spec
from vllmpy.pooling.params import PoolingParams
from vllmpy.pooling.pooler import Pooler


def st_dir(tmp_path, pooling: dict, modules: list[str], prompts: dict | None = None,
           dense: dict | None = None):
    entries = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"}]
    for i, kind in enumerate(modules, 1):
        path = {"Pooling": "1_Pooling", "Dense": f"{i}_Dense", "Normalize": f"{i}_Normalize"}
        entries.append({"idx": i, "name": str(i), "path": path[kind],
                        "type": f"sentence_transformers.models.{kind}"})
        if kind == "Pooling":
            (tmp_path / "1_Pooling").mkdir()
            (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        if kind == "Dense":
            folder = tmp_path / f"{i}_Dense"
            folder.mkdir()
            cfg = dense or {"in_features": 8, "out_features": 4, "bias": True,
                            "activation_function": "torch.nn.modules.activation.Tanh"}
            (folder / "config.json").write_text(json.dumps(cfg))
            torch.manual_seed(i)
            tensors = {"linear.weight": torch.randn(cfg["out_features"], cfg["in_features"])}
            if cfg.get("bias", True):
                tensors["linear.bias"] = torch.randn(cfg["out_features"])
            save_file(tensors, str(folder / "model.safetensors"))
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 77}))
    if prompts is not None:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    return str(tmp_path)


MEAN = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}


def test_a_sentence_transformers_directory_gives_its_modules(tmp_path):
    path = st_dir(tmp_path, MEAN, ["Pooling", "Dense", "Normalize"],
                  {"prompts": {"query": "q: "}, "default_prompt_name": "query"})
    spec = pooling_spec(path, "CLS", False, {})
    assert (spec.pooling_type, spec.normalize, spec.max_seq_length) == ("MEAN", True, 77)
    assert spec.default_prompt == "q: " and len(spec.dense) == 1
    assert spec.dense[0].activation == "tanh"
    # --pooler-config overrides the type and the normalization
    spec = pooling_spec(path, "CLS", False,
                        parse_pooler_config('{"pooling_type": "cls", "normalize": false}'))
    assert (spec.pooling_type, spec.normalize) == ("CLS", False)
    # no sentence-transformers files: the model's default
    plain = tmp_path / "plain"
    plain.mkdir()
    assert pooling_spec(str(plain), "CLS", True, {}).pooling_type == "CLS"


@pytest.mark.parametrize("pooling, modules, message", [
    ({"pooling_mode_max_tokens": True}, ["Pooling"], "pooling_mode_max_tokens is not supp"),
    (dict(MEAN, include_prompt=False), ["Pooling"], "include_prompt false"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, ["Pooling"],
     "exactly one pooling mode"),
])
def test_unbuilt_sentence_transformers_pooling_is_refused(tmp_path, pooling, modules, message):
    with pytest.raises(ConfigError, match=message):
        pooling_spec(st_dir(tmp_path, pooling, modules), "CLS", True, {})


def test_unbuilt_dense_activation_and_modules_are_refused(tmp_path):
    dense = {"in_features": 8, "out_features": 4,
             "activation_function": "torch.nn.modules.activation.ReLU6"}
    with pytest.raises(ConfigError, match="activation 'torch.nn.modules.activation.ReLU6'"):
        pooling_spec(st_dir(tmp_path, MEAN, ["Pooling", "Dense"], dense=dense), "CLS", True, {})
    other = tmp_path / "other"
    other.mkdir()
    (other / "modules.json").write_text(json.dumps(
        [{"idx": 0, "path": "x", "type": "sentence_transformers.models.LSTM"}]))
    with pytest.raises(ConfigError, match="LSTM"):
        pooling_spec(str(other), "CLS", True, {})


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"), ("[1]", "must be a JSON object"),
    ('{"normalize": "yes"}', "normalize must be true or false"),
])
def test_bad_pooler_config_is_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_pooler_config(value)


class _Classifier(torch.nn.Module):
    num_labels = 3

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.head = torch.nn.Linear(8, 3)

    def classify(self, pooled):
        return self.head(pooled)


def test_pooler_arithmetic_against_torch(tmp_path):
    path = st_dir(tmp_path, MEAN, ["Pooling", "Dense", "Normalize"])
    spec = pooling_spec(path, "CLS", False, {})
    pooler = Pooler(torch.nn.Identity(), spec, torch.device("cpu"), torch.float32, 8)
    torch.manual_seed(0)
    hidden = torch.randn(10, 8)
    starts, lengths = [0, 3, 4], [3, 1, 6]
    ids = [np.arange(n) for n in lengths]
    dense = pooler.dense[0][0]
    out = pooler(hidden, starts, lengths, ids, [PoolingParams()] * 2 + [
        PoolingParams(normalize=False)])
    for i, (s, n) in enumerate(zip(starts, lengths)):
        want = torch.tanh(dense(hidden[s:s + n].mean(0)))
        want = want if i == 2 else F.normalize(want, dim=0)
        torch.testing.assert_close(torch.from_numpy(out[i]), want.detach(), atol=1e-6, rtol=0)
    # encode: every token's state
    states = pooler(hidden, starts, lengths, ids, [PoolingParams(task="encode")] * 3)
    torch.testing.assert_close(torch.from_numpy(states[2]), hidden[4:10])
    # a classification head: softmax, or the logits with use_activation off
    cls = Pooler(_Classifier(), pooling_spec(None, "CLS", False, {}), torch.device("cpu"),
                 torch.float32, 8)
    probs = cls(hidden, starts, lengths, ids,
                [PoolingParams(task="classify"), PoolingParams(task="classify",
                                                               use_activation=False)] * 1
                + [PoolingParams(task="classify")])
    logits = cls.model.head(hidden[[0, 3, 4]]).detach()
    torch.testing.assert_close(torch.from_numpy(probs[0]), logits[0].softmax(0))
    torch.testing.assert_close(torch.from_numpy(probs[1]), logits[1])
    assert cls.tasks == ("classify", "score", "encode")
