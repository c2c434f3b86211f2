"""What each layer of a model caches between steps, as the model's config declares it.

Three kinds:

- ``PagedKVSpec``: keys and values of full or sliding-window attention, paged in blocks of
  ``block_size`` tokens: one tensor [2, num_blocks, block_size, num_kv_heads, head_dim].
- ``MLASpec``: multi-head latent attention's one shared latent per token (the compressed
  ``kv_lora_rank`` values and the ``qk_rope_head_dim`` rotated key), paged the same way:
  one tensor [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim].
- ``RecurrentStateSpec``: a fixed-size state per sequence (a Mamba2 or Gated DeltaNet
  layer's convolution window and SSM/delta state), kept in *seats*: each named tensor is
  [num_seats + 1, *shape]; a running request owns one seat for its whole life (given back
  when it finishes or is preempted), and the last seat is scratch that padding rows of a
  step write into.

The KV pool is sized across them (``CacheLayout``): every paged layer takes its share of
a block, every recurrent layer its share of a seat. Paged layers find their tokens through
the step's block tables and slot mapping; recurrent layers through
``AttentionMetadata.state_indices`` (each request's seat).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The dtypes a recurrent state tensor may name: the model's activations ("model") or the
# SSM/delta state's own (--mamba-ssm-cache-dtype: the model's by default, or float32).
STATE_DTYPE_ROLES = ("model", "ssm")


@dataclass(frozen=True)
class PagedKVSpec:
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        """The shape one block takes, before the num_blocks axis is inserted at 1."""
        return (2, block_size, self.num_kv_heads, self.head_dim)

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * kv_dtype.itemsize


@dataclass(frozen=True)
class MLASpec:
    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.latent_dim)

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return block_size * self.latent_dim * kv_dtype.itemsize


@dataclass(frozen=True)
class StateTensor:
    name: str  # e.g. "conv", "ssm"
    shape: tuple[int, ...]  # per seat
    dtype_role: str  # one of STATE_DTYPE_ROLES

    def __post_init__(self) -> None:
        if self.dtype_role not in STATE_DTYPE_ROLES:
            raise ValueError(f"state tensor {self.name!r}: dtype role must be one of "
                             f"{STATE_DTYPE_ROLES}, got {self.dtype_role!r}")


@dataclass(frozen=True)
class RecurrentStateSpec:
    kind: str  # "mamba2", "gated_deltanet": named in the start-up line
    tensors: tuple[StateTensor, ...]

    def bytes_per_seat(self, model_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        total = 0
        for t in self.tensors:
            dtype = model_dtype if t.dtype_role == "model" else ssm_dtype
            numel = 1
            for d in t.shape:
                numel *= d
            total += numel * dtype.itemsize
        return total

    def allocate(self, num_seats: int, model_dtype: torch.dtype, ssm_dtype: torch.dtype,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
        """Zeroed tensors [num_seats + 1, *shape] (the last seat is the padding rows')."""
        return {t.name: torch.zeros((num_seats + 1, *t.shape),
                                    dtype=model_dtype if t.dtype_role == "model" else ssm_dtype,
                                    device=device)
                for t in self.tensors}


CacheSpec = PagedKVSpec | MLASpec | RecurrentStateSpec
PAGED_SPECS = (PagedKVSpec, MLASpec)


@dataclass(frozen=True)
class CacheLayout:
    """A model's per-layer cache specs (the layers that cache anything, in model order),
    and what one block and one seat cost across them."""

    specs: tuple[CacheSpec, ...]

    @property
    def paged(self) -> list[PagedKVSpec | MLASpec]:
        return [s for s in self.specs if isinstance(s, PAGED_SPECS)]

    @property
    def recurrent(self) -> list[RecurrentStateSpec]:
        return [s for s in self.specs if isinstance(s, RecurrentStateSpec)]

    @property
    def is_hybrid(self) -> bool:
        """Whether any layer keeps a recurrent state (seats bound concurrency)."""
        return bool(self.recurrent)

    def bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return sum(s.bytes_per_block(block_size, kv_dtype) for s in self.paged)

    def bytes_per_seat(self, model_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        return sum(s.bytes_per_seat(model_dtype, ssm_dtype) for s in self.recurrent)

    def describe(self) -> str:
        """The groups, for the start-up line: e.g. '12 full-attention, 36 gated_deltanet'."""
        counts: dict[str, int] = {}
        for s in self.specs:
            if isinstance(s, PagedKVSpec):
                name = "sliding-window" if s.sliding_window else "full-attention"
            elif isinstance(s, MLASpec):
                name = "MLA-latent"
            else:
                name = s.kind
            counts[name] = counts.get(name, 0) + 1
        return ", ".join(f"{n} {name}" for name, n in counts.items())
