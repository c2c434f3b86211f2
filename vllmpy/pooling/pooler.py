"""From a pooling step's hidden states to each request's output.

The step's tokens are whole prompts, packed: request ``i`` owns rows ``starts[i]`` to
``starts[i] + lengths[i]``. Every request of a step is pooled in one batch of tensor ops:

- CLS: the first token's state; LAST: the last token's; MEAN: the average over the
  prompt (fp32 sums); ALL: every token's state; STEP: the states at the positions of the
  ``step_tag_id`` token (every position when none is set).
- embed: the pooled vector through the checkpoint's Dense layers, its first ``dimensions``
  kept, then L2-normalized when the request (or the checkpoint's default) says so.
- classify / score: the model's classification head on the pooled state, then softmax (or
  sigmoid for one label) unless the request turns the activation off.
- encode: ALL's (or STEP's) rows, as they are.

Outputs leave as float32 numpy arrays, one per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.config import ConfigError
from vllmpy.pooling.config import DenseSpec, PoolingSpec
from vllmpy.pooling.params import PoolingParams


def _load_dense(spec: DenseSpec, device: torch.device, dtype: torch.dtype) -> nn.Linear:
    import os

    from safetensors.torch import load_file

    path = os.path.join(spec.path, "model.safetensors")
    if os.path.isfile(path):
        tensors = load_file(path)
    else:
        path = os.path.join(spec.path, "pytorch_model.bin")
        if not os.path.isfile(path):
            raise ConfigError(f"sentence-transformers Dense {spec.path}: no model.safetensors "
                              f"or pytorch_model.bin")
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    weight = tensors.get("linear.weight")
    if weight is None or tuple(weight.shape) != (spec.out_features, spec.in_features):
        raise ConfigError(f"sentence-transformers Dense {spec.path}: expected linear.weight "
                          f"of shape [{spec.out_features}, {spec.in_features}], got "
                          f"{None if weight is None else list(weight.shape)}")
    layer = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias,
                      device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if spec.bias:
            layer.bias.copy_(tensors["linear.bias"])
    return layer


_ACTIVATIONS = {"identity": lambda x: x, "tanh": torch.tanh, "gelu": F.gelu}


class Pooler:
    """The pooling of one model: its spec, its Dense layers and its head."""

    def __init__(self, model: nn.Module, spec: PoolingSpec, device: torch.device,
                 dtype: torch.dtype, hidden_size: int) -> None:
        self.model = model
        self.spec = spec
        self.dense = [(_load_dense(d, device, dtype), _ACTIVATIONS[d.activation])
                      for d in spec.dense]
        width = hidden_size
        for d in spec.dense:
            if d.in_features != width:
                raise ConfigError(f"sentence-transformers Dense {d.path} takes "
                                  f"{d.in_features} features, but the model gives {width}")
            width = d.out_features
        self.embed_size = width
        self.classifies = callable(getattr(model, "classify", None))
        self.num_labels = int(getattr(model, "num_labels", 0) or 0)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this model serves."""
        return ("classify", "score", "encode") if self.classifies else ("embed", "score",
                                                                        "encode")

    def _pool(self, hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
              kind: str) -> torch.Tensor:
        if kind == "CLS":
            return hidden[starts]
        if kind == "LAST":
            return hidden[starts + lengths - 1]
        if kind == "MEAN":
            seq = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device),
                                          lengths)
            sums = torch.zeros(len(starts), hidden.shape[1], dtype=torch.float32,
                               device=hidden.device)
            sums.index_add_(0, seq, hidden.float())
            return (sums / lengths[:, None].float()).to(hidden.dtype)
        raise AssertionError(kind)

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, starts: Sequence[int], lengths: Sequence[int],
                 input_ids: Sequence[np.ndarray], params: Sequence[PoolingParams]
                 ) -> list[np.ndarray]:
        device = hidden.device
        kind = self.spec.pooling_type
        out: list[Any] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.task != "encode"]
        if rows:
            if kind in ("ALL", "STEP"):
                raise ValueError(f"the {kind} pooling gives token states: a "
                                 f"{params[rows[0]].task} request needs one vector per "
                                 f"prompt (CLS, MEAN or LAST pooling)")
            s = torch.tensor([starts[i] for i in rows], device=device)
            n = torch.tensor([lengths[i] for i in rows], device=device)
            pooled = self._pool(hidden, s, n, kind)
            if self.classifies:
                values = self._classify(pooled, [params[i] for i in rows])
            else:
                values = self._embed(pooled, [params[i] for i in rows])
            host = values.float().cpu().numpy()
            for j, i in enumerate(rows):
                out[i] = host[j] if params[i].dimensions is None else \
                    host[j, :params[i].dimensions]
        for i, p in enumerate(params):
            if p.task == "encode":
                states = hidden[starts[i]:starts[i] + lengths[i]]
                if kind == "STEP" and self.spec.step_tag_id is not None:
                    keep = np.nonzero(np.asarray(input_ids[i]) == self.spec.step_tag_id)[0]
                    states = states[torch.as_tensor(keep, device=device)]
                out[i] = states.float().cpu().numpy()
        return out

    def _embed(self, pooled: torch.Tensor, params: Sequence[PoolingParams]) -> torch.Tensor:
        x = pooled
        for layer, act in self.dense:
            x = act(layer(x))
        x = x.float()
        dims = {p.dimensions for p in params}
        norms = [self.spec.normalize if p.normalize is None else p.normalize for p in params]
        if dims == {None}:
            if all(norms):
                return F.normalize(x, dim=-1)
            if not any(norms):
                return x
        rows = []
        for row, p, norm in zip(x, params, norms):
            v = row if p.dimensions is None else row[:p.dimensions]
            v = F.normalize(v, dim=-1) if norm else v
            rows.append(F.pad(v, (0, x.shape[1] - v.shape[0])))
        return torch.stack(rows)

    def _classify(self, pooled: torch.Tensor, params: Sequence[PoolingParams]) -> torch.Tensor:
        logits = self.model.classify(pooled).float()  # type: ignore[operator]
        if logits.shape[1] == 1:
            activated = torch.sigmoid(logits)
        else:
            activated = logits.softmax(dim=-1)
        use = torch.tensor([p.use_activation is not False for p in params],
                           device=logits.device)
        return torch.where(use[:, None], activated, logits)
