"""Applying a step's grammar bitmask to the logits, on their device, before sampling."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray,
                          rows: Sequence[int]) -> torch.Tensor:
    """Set to -inf, in place, the logits of the tokens a grammar forbids; returns ``logits``.

    ``logits`` is ``[num_rows, vocab_size]``; ``bitmask`` is int32
    ``[len(rows), ceil(vocab_size / 32)]``, and its row ``i`` applies to logits row
    ``rows[i]``: bit ``j`` of word ``w`` set allows token ``32 * w + j``. Rows not named
    are left alone. The mask is unpacked on the logits' device; nothing is read back.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab_size], got {tuple(logits.shape)}")
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != len(rows):
        raise ValueError(f"the bitmask must be int32 [{len(rows)}, words], got "
                         f"{bitmask.dtype} {bitmask.shape}")
    vocab_size = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words covers "
                         f"{bitmask.shape[1] * 32} tokens, fewer than the {vocab_size} logits")
    if not len(rows):
        return logits
    device = logits.device
    words = torch.from_numpy(bitmask).to(device, non_blocking=True)  # [n, words]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    # [n, words, 32] -> [n, words * 32]: bit j of word w is token 32 * w + j
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    index = torch.as_tensor(list(rows), dtype=torch.int64, device=device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def apply_step_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray,
                               structured_output_request_ids: dict[str, int],
                               sampled_req_ids: Sequence[str]) -> torch.Tensor:
    """The runner's call: ``logits`` row ``k`` belongs to ``sampled_req_ids[k]``, and
    ``structured_output_request_ids`` maps a request to its bitmask row (as
    SchedulerOutput carries them). Masks in place and returns ``logits``."""
    position = {req_id: k for k, req_id in enumerate(sampled_req_ids)}
    pairs = [(row, position[req_id])
             for req_id, row in structured_output_request_ids.items() if req_id in position]
    return apply_grammar_bitmask(logits, bitmask[[row for row, _ in pairs]],
                                 [k for _, k in pairs])
