"""What attention needs to know about one step: where each request's tokens are, and
where their keys and values live in the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """The step's tokens are the concatenation of every scheduled request's new tokens.

    Request i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those tokens are
    the last ones of its ``seq_lens[i]`` known tokens, whose keys and values sit in the
    cache blocks ``block_tables[i, :ceil(seq_lens[i] / block_size)]``.
    """

    num_actual_tokens: int
    # [num_reqs + 1] int32, cumulative query lengths (device and host copies)
    query_start_loc: torch.Tensor
    query_start_loc_cpu: list[int]
    # [num_reqs] int32, tokens in the cache after this step (context + new)
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    # [num_tokens] int64, the cache slot (block_id * block_size + offset) of each new token
    slot_mapping: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32, padded with 0
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int = 0  # longest query of the step (1 for a pure decode step)
    max_seq_len: int = 0  # longest seq_len of the step
    # Hybrid models: [num_reqs] int32, the recurrent-state seat of each request (padding
    # requests: the scratch seat, num_seats); None when no layer keeps a recurrent state.
    state_indices: torch.Tensor | None = None
    state_indices_cpu: list[int] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)
