"""A model built on the meta device gets its storage on the target device and dtype."""

from __future__ import annotations

import torch
from torch import nn

from vllmpy.loader.materialize import materialize


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6, bias=True)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied, as an lm_head to its embedding
        self.also_embed = self.embed  # one module reachable under two names
        self.register_buffer("index", torch.arange(3))
        self.register_buffer("scale", torch.ones(2))


def test_storage_dtype_and_ties():
    with torch.device("meta"):
        model = Tied()
    materialize(model, torch.device("cpu"), torch.bfloat16)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in params.values())
    assert all(isinstance(p, nn.Parameter) for p in params.values())
    assert model.head.weight is model.embed.weight  # still one tensor
    assert model.also_embed.bias is model.embed.bias
    assert model.index.dtype == torch.int64 and model.index.device.type == "cpu"
    assert model.scale.dtype == torch.bfloat16
    assert [tuple(p.shape) for p in (model.embed.weight, model.embed.bias)] == [(6, 4), (6,)]
    with torch.no_grad():
        model.embed.weight.fill_(2.0)
    assert torch.equal(model.head.weight, torch.full((6, 4), 2.0, dtype=torch.bfloat16))
