"""Declared weight loading: checkpoint names -> (packed) parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllmpy.config import log
from vllmpy.layers.linear import (
    Linear,
    PackedLinear,
    default_weight_loader,
    describe_quantized_layers,
)


class WeightLoadError(ValueError):
    pass


# checkpoint name fragment -> (packed parameter fragment, shard id) for the layers built
# from ``SelfAttention`` (q/k/v -> qkv_proj) and ``GatedMLP`` (gate/up -> gate_up_proj)
PACKED_QKV_GATE_UP: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules: dict[str, tuple[str, str | int]],
    skip_suffixes: tuple[str, ...] = (),
) -> set[str]:
    """Copy each checkpoint tensor into its parameter.

    ``packed_modules`` maps a checkpoint module name (``q_proj``) to the packed module
    that holds it (``qkv_proj``) and the shard id inside it. A checkpoint name with no
    matching parameter is refused by name; so is a parameter the checkpoint never filled.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    filled_shards: dict[str, set[str | int]] = {}
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        target, shard_id = name, None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in packed_modules:
                packed, shard_id = packed_modules[part]
                target = ".".join(parts[:i] + [packed] + parts[i + 1:])
                break
        if target not in params:
            raise WeightLoadError(f"checkpoint tensor {name!r} has no matching model parameter")
        param = params[target]
        module = modules[target.rpartition(".")[0]]
        if shard_id is None:
            if isinstance(module, Linear) and param is module.weight:
                module.load_weight(tensor, name)  # may keep a quantized weight quantized
            else:
                default_weight_loader(param, tensor, name)
            loaded.add(target)
            continue
        assert isinstance(module, PackedLinear)
        module.weight_loader(param, tensor, shard_id, name)
        filled_shards.setdefault(target, set()).add(shard_id)
        if filled_shards[target] == set(module.shard_offsets):
            loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise WeightLoadError(
            f"checkpoint is missing {len(missing)} tensor(s) the model needs, e.g. {missing[:5]}")
    if (line := describe_quantized_layers(model)) is not None:
        log(line)
    return loaded
