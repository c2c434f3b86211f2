"""What a checkpoint says about pooling, and ``--pooler-config`` (vLLM's PoolerConfig JSON).

A sentence-transformers directory lists its modules in ``modules.json``: the Transformer
(the model itself), a Pooling module (``1_Pooling/config.json``: CLS, mean, last token,
...), optional Dense layers (``2_Dense/``: a linear map with its own weights and
activation) and Normalize. Read here, they make the same vector sentence-transformers
makes. ``sentence_bert_config.json``'s ``max_seq_length`` caps the prompt length, and
``config_sentence_transformers.json``'s ``prompts`` / ``default_prompt_name`` are the
texts sentence-transformers puts before an input. ``--pooler-config`` overrides the
pooling type and the normalization.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from vllmpy.config import ConfigError

POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL", "STEP")
FLAG = "--pooler-config"

# Pooling's mode keys -> our type; sentence-transformers' other modes are refused by name.
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_lasttoken": "LAST"}
_ST_UNBUILT = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens")
# Dense activations (the torch class name sentence-transformers stores) that are built
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
                     "torch.nn.modules.activation.Tanh": "tanh",
                     "torch.nn.modules.activation.GELU": "gelu"}


@dataclass(frozen=True)
class DenseSpec:
    """One sentence-transformers Dense module: ``linear`` (+ bias) then its activation."""

    path: str  # its folder (config.json, model.safetensors or pytorch_model.bin)
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a DENSE_ACTIVATIONS value


@dataclass(frozen=True)
class PoolingSpec:
    """How the engine pools, after the checkpoint and --pooler-config have spoken."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # the embed task's default
    dense: tuple[DenseSpec, ...] = ()
    max_seq_length: int | None = None  # sentence-transformers' cap on the prompt
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None  # text put before every text input, if any
    step_tag_id: int | None = None  # STEP: the token whose positions are returned
    source: str = "the model's default"  # where the pooling type came from (start-up line)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"sentence-transformers config {path}: {e}") from None


def parse_pooler_config(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """--pooler-config as a dict of the keys built here; unknown keys are refused."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{FLAG}: not valid JSON ({e}); e.g. "
                              f"'{{\"pooling_type\": \"MEAN\", \"normalize\": true}}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{FLAG} must be a JSON object, got {type(value).__name__}")
    known = {"pooling_type", "normalize", "step_tag_id", "use_activation"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{FLAG}: unknown or unsupported keys {unknown}; the keys built "
                          f"are {sorted(known)}")
    if "pooling_type" in value:
        kind = str(value["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ConfigError(f"{FLAG}: pooling_type must be one of {list(POOLING_TYPES)}, "
                              f"got {value['pooling_type']!r}")
        value = dict(value, pooling_type=kind)
    for key in ("normalize", "use_activation"):
        if key in value and not isinstance(value[key], bool):
            raise ConfigError(f"{FLAG}: {key} must be true or false, got {value[key]!r}")
    if "step_tag_id" in value and not isinstance(value["step_tag_id"], int):
        raise ConfigError(f"{FLAG}: step_tag_id must be a token id, got {value['step_tag_id']!r}")
    return value


def _st_pooling(folder: str) -> str:
    cfg = _read_json(os.path.join(folder, "config.json"))
    for key in _ST_UNBUILT:
        if cfg.get(key):
            raise ConfigError(f"sentence-transformers pooling {folder}: {key} is not "
                              f"supported (CLS, mean and last-token pooling are)")
    if cfg.get("include_prompt", True) is False:
        raise ConfigError(f"sentence-transformers pooling {folder}: include_prompt false "
                          f"(pooling that leaves the prompt's tokens out) is not supported")
    modes = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
    if len(modes) != 1:
        raise ConfigError(f"sentence-transformers pooling {folder}: expected exactly one "
                          f"pooling mode, got {modes or 'none'}")
    return modes[0]


def _st_dense(folder: str) -> DenseSpec:
    cfg = _read_json(os.path.join(folder, "config.json"))
    act = cfg.get("activation_function", "torch.nn.modules.linear.Identity")
    if act not in DENSE_ACTIVATIONS:
        raise ConfigError(f"sentence-transformers Dense {folder}: activation {act!r} is not "
                          f"supported (supported: {sorted(DENSE_ACTIVATIONS)})")
    return DenseSpec(folder, int(cfg["in_features"]), int(cfg["out_features"]),
                     bool(cfg.get("bias", True)), DENSE_ACTIVATIONS[act])


def read_sentence_transformers(model_dir: str | None) -> dict[str, Any]:
    """The pooling a sentence-transformers directory declares (empty when it is not one)."""
    if model_dir is None or not os.path.isfile(os.path.join(model_dir, "modules.json")):
        return {}
    found: dict[str, Any] = {"normalize": False, "dense": []}
    for module in _read_json(os.path.join(model_dir, "modules.json")):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = os.path.join(model_dir, module.get("path", ""))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            found["pooling_type"] = _st_pooling(path)
        elif kind == "Dense":
            found["dense"].append(_st_dense(path))
        elif kind == "Normalize":
            found["normalize"] = True
        else:
            raise ConfigError(f"sentence-transformers module {module.get('type')!r} "
                              f"({path}) is not supported (Transformer, Pooling, Dense and "
                              f"Normalize are)")
    bert = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(bert):
        found["max_seq_length"] = _read_json(bert).get("max_seq_length")
    st = os.path.join(model_dir, "config_sentence_transformers.json")
    if os.path.isfile(st):
        cfg = _read_json(st)
        found["prompts"] = dict(cfg.get("prompts") or {})
        name = cfg.get("default_prompt_name")
        if name is not None:
            if name not in found["prompts"]:
                raise ConfigError(f"{st}: default_prompt_name {name!r} names no prompt")
            found["default_prompt"] = found["prompts"][name]
    return found


def pooling_spec(model_dir: str | None, default_type: str, default_normalize: bool,
                 pooler_config: dict[str, Any]) -> PoolingSpec:
    """The checkpoint's pooling (sentence-transformers files, else the model's default),
    overridden by ``pooler_config`` (parsed --pooler-config)."""
    st = read_sentence_transformers(model_dir)
    kind, source = default_type, "the model's default"
    if "pooling_type" in st:
        kind, source = st["pooling_type"], "sentence-transformers' 1_Pooling"
    normalize = st.get("normalize", default_normalize) if st else default_normalize
    if "pooling_type" in pooler_config:
        kind, source = pooler_config["pooling_type"], FLAG
    normalize = pooler_config.get("normalize", normalize)
    return PoolingSpec(pooling_type=kind, normalize=normalize, dense=tuple(st.get("dense", ())),
                       max_seq_length=st.get("max_seq_length"), prompts=st.get("prompts", {}),
                       default_prompt=st.get("default_prompt"),
                       step_tag_id=pooler_config.get("step_tag_id"), source=source)
