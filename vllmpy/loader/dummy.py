"""Random weights for ``--load-format dummy``: a model's shapes, no checkpoint.

The values keep a Llama-family forward pass numerically sane (no overflow in float16,
logits near zero): matrices and embeddings are drawn from normal(0, 0.02), the init
Hugging Face uses; norm weights are ones, as a freshly built RMSNorm/LayerNorm has;
biases are zeros.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

INIT_STD = 0.02


def _is_norm_weight(name: str, shape: torch.Size) -> bool:
    return len(shape) == 1 and name.endswith("norm.weight")


def _tensor_seed(seed: int, name: str) -> int:
    """A seed per tensor from the run seed and the name, independent of dict order."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def dummy_weights(
    param_shapes: dict[str, tuple[torch.Size, torch.dtype]], seed: int = 0,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` with a random tensor on ``device`` for each entry of
    ``param_shapes`` (drawn there: start-up stays fast for large models on a GPU).

    ``param_shapes`` maps a parameter name to its shape and dtype. The same seed gives the
    same tensor for the same name and shape, whatever else is in the dict. A non-floating
    dtype is refused naming the parameter.
    """
    for name, (shape, dtype) in param_shapes.items():
        if not dtype.is_floating_point:
            raise ValueError(
                f"dummy weights are floating point only; parameter {name!r} has dtype {dtype}"
            )
        shape = torch.Size(shape)
        if _is_norm_weight(name, shape):
            tensor = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        else:
            generator = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
            tensor = torch.empty(shape, dtype=torch.float32, device=device).normal_(
                0.0, INIT_STD, generator=generator
            )
            tensor = tensor.to(dtype)
        yield name, tensor
