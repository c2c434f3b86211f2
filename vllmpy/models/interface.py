"""What the model runner needs of every model class."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from vllmpy.attention.metadata import AttentionMetadata


class CausalLM(Protocol):
    """A decoder-only model over the flattened tokens of one step."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size] hidden states."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """[num_sampled, hidden_size] -> [num_sampled, vocab_size], into ``out`` if given"""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) in; returns the parameters loaded."""
        ...
