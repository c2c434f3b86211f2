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


def _subtree_owner(name: str, subtrees: dict[str, nn.Module]) -> str | None:
    """The module of ``subtrees`` whose name prefixes checkpoint name ``name``, if any."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in subtrees:
            return prefix
    return None


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules: dict[str, tuple[str, str | int]],
    skip_suffixes: tuple[str, ...] = (),
) -> set[str]:
    """Copy each checkpoint tensor into its layer.

    ``packed_modules`` maps a checkpoint module name (``q_proj``) to the packed module
    that holds it (``qkv_proj``) and the shard id inside it. A linear layer (and an
    embedding) takes its tensors through ``load_tensor``, which hands them to its
    quantization method (``weight``, ``weight_scale``, ``qweight``...). A checkpoint name
    with no matching layer or parameter is refused by name; so is a parameter, or a linear
    layer's tensor, the checkpoint never filled.
    """
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    linears = {n: m for n, m in modules.items() if isinstance(m, Linear)}
    linear_params = {f"{n}.{p}" for n, m in linears.items()
                     for p, _ in m.named_parameters(recurse=False)}
    # layers that take a whole checkpoint subtree (a MoE layer's ``experts.N.*``)
    subtrees = {n: m for n, m in modules.items() if hasattr(m, "load_expert_tensor")}
    subtree_params = {f"{n}.{p}" for n, m in subtrees.items()
                      for p, _ in m.named_parameters(recurse=False)}
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(skip_suffixes):
            continue
        owner = _subtree_owner(name, subtrees) if subtrees else None
        if owner is not None:
            subtrees[owner].load_expert_tensor(name[len(owner) + 1:], tensor, name)
            continue
        target, shard_id = name, None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in packed_modules:
                packed, shard_id = packed_modules[part]
                target = ".".join(parts[:i] + [packed] + parts[i + 1:])
                break
        owner, _, suffix = target.rpartition(".")
        module = modules.get(owner)
        if shard_id is not None and not isinstance(module, PackedLinear):
            raise WeightLoadError(f"checkpoint tensor {name!r} has no matching model parameter")
        if isinstance(module, Linear) or (hasattr(module, "load_tensor")
                                          and target in params):
            module.load_tensor(suffix, tensor, shard_id, name)  # type: ignore[union-attr]
            loaded.add(target)
            continue
        if target not in params:
            raise WeightLoadError(f"checkpoint tensor {name!r} has no matching model parameter")
        default_weight_loader(params[target], tensor, name)
        loaded.add(target)
    missing = sorted(n for n in set(params) - loaded - linear_params - subtree_params)
    missing += [f"{n}.{m}" for n, layer in linears.items() for m in layer.missing()]
    missing += [f"{n}.{m}" for n, layer in subtrees.items() for m in layer.missing()]
    if missing:
        raise WeightLoadError(
            f"checkpoint is missing {len(missing)} tensor(s) the model needs, e.g. {missing[:5]}")
    if (line := describe_quantized_layers(model)) is not None:
        log(line)
    return loaded
