"""The rejection sampler: which draft tokens the target model accepts, on the device.

A request that verifies ``k`` drafts ``d_0 .. d_{k-1}`` has ``k + 1`` consecutive rows of
target logits: row ``j`` scores the position after the tokens so far plus ``d_0 .. d_{j-1}``
(its sampling metadata sees those drafts as outputs, so penalties, min_tokens and seeds
are the ones the non-speculative step at that position would use). Walking the rows in
order:

- greedy: ``d_j`` is accepted while it is the argmax of row ``j``; the first row whose
  argmax differs emits that argmax instead, and the step ends there;
- random (Leviathan et al. 2023, Chen et al. 2023): ``d_j`` is accepted with probability
  ``min(1, p_j(d_j) / q_j(d_j))``, ``p_j`` the target's distribution after temperature,
  min-p, top-k and top-p, ``q_j`` the draft's (one-hot at ``d_j`` for a proposer that
  picks deterministically, as every proposer here does: then the test is ``u < p(d)``);
  the first rejected row emits a token drawn from ``max(p_j - q_j, 0)`` renormalised.

When every draft is accepted, row ``k`` emits a bonus token drawn from it (or its argmax).
Each request thus emits between 1 and ``k + 1`` tokens, distributed exactly as the
non-speculative sampler's. A seeded row draws its uniform and its resampling noise from
its own generator, so a seeded request repeats exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllmpy.sample.metadata import SamplingMetadata
from vllmpy.sample.sampler import (
    _TINY,
    apply_logits_processors,
    apply_sampling_filters,
    greedy_ids,
)


@dataclass
class RejectionOutput:
    """The verified tokens of ``num_reqs`` requests."""

    # [num_reqs, max_k + 1] int64: each request's emitted tokens, then -1
    token_ids: torch.Tensor
    # [num_reqs] int64: how many tokens each request emits (accepted drafts + 1)
    num_emitted: torch.Tensor
    # [rows] int64: the token each logits row stands for (the accepted draft, the emitted
    # replacement or bonus; anything on rows past the first rejection): what logprobs score
    row_tokens: torch.Tensor
    # [rows, vocab] float32: the distribution each row was verified against, as logits
    processed_logits: torch.Tensor


def rejection_sample(logits: torch.Tensor, metadata: SamplingMetadata,
                     num_drafts: Sequence[int], draft_token_ids: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> RejectionOutput:
    """Verify the drafts of ``len(num_drafts)`` requests.

    ``logits`` [sum(k_i + 1), vocab]: request ``i``'s ``k_i + 1`` rows in a row, requests in
    order; ``metadata`` has one row per logits row. ``draft_token_ids`` [sum(k_i)] int64:
    the drafts in the same order; ``draft_probs`` [sum(k_i), vocab] their proposal
    distributions, None for deterministic drafts (one-hot).
    """
    device = logits.device
    num_reqs, num_rows = len(num_drafts), logits.shape[0]
    total_drafts = sum(num_drafts)
    if num_rows != total_drafts + num_reqs or metadata.num_reqs != num_rows:
        raise ValueError(f"{num_rows} logits rows and {metadata.num_reqs} metadata rows for "
                         f"{num_reqs} requests verifying {total_drafts} drafts (need "
                         f"{total_drafts + num_reqs})")
    if draft_token_ids.shape != (total_drafts,):
        raise ValueError(f"draft_token_ids of shape {tuple(draft_token_ids.shape)} for "
                         f"{total_drafts} drafts")
    # Each row's request, its index within the request, whether it verifies a draft, and
    # the draft rows: known on the host, sent in one copy that does not wait for the GPU.
    counts = np.asarray(num_drafts, dtype=np.int64)
    req_of_row = np.repeat(np.arange(num_reqs), counts + 1)
    pos_of_row = np.arange(num_rows) - (np.cumsum(counts + 1) - (counts + 1))[req_of_row]
    draft_of_row = pos_of_row < counts[req_of_row]
    layout = to_device(np.concatenate([req_of_row, pos_of_row, draft_of_row,
                                       np.nonzero(draft_of_row)[0]]), device)
    row_req, row_pos = layout[:num_rows], layout[num_rows:2 * num_rows]
    is_draft = layout[2 * num_rows:3 * num_rows].bool()
    draft_rows = layout[3 * num_rows:]
    # The draft each draft row verifies (0 on bonus rows).
    row_draft = torch.zeros(num_rows, dtype=torch.int64, device=device)
    row_draft.index_copy_(0, draft_rows, draft_token_ids)

    md = metadata
    processed = apply_logits_processors(logits.float(), md)
    greedy = None if md.all_random else greedy_ids(processed)
    if md.all_greedy:
        assert greedy is not None
        accepted = is_draft & (row_draft == greedy)
        fallback = greedy
    else:
        processed = apply_sampling_filters(processed, md)
        probs = processed.softmax(dim=-1)
        uniform, noise = _draws(probs, md.generators)
        p_draft = probs.gather(1, row_draft.unsqueeze(1)).squeeze(1)
        residual = probs.clone()
        if draft_probs is None:  # one-hot proposals: accept with p(d), else p without d
            q_draft = torch.ones_like(p_draft)
            residual[draft_rows, draft_token_ids] = 0.0
        else:
            if draft_probs.shape != (total_drafts, probs.shape[1]):
                raise ValueError(f"draft_probs of shape {tuple(draft_probs.shape)} for "
                                 f"{total_drafts} drafts of vocab {probs.shape[1]}")
            q = draft_probs.float()
            q_draft = torch.ones_like(p_draft)
            q_draft.index_copy_(0, draft_rows,
                                q.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1))
            residual[draft_rows] = (probs[draft_rows] - q).clamp_(min=0.0)
        accepted = is_draft & (uniform * q_draft < p_draft)
        # A rejected row's residual has mass (p(d) < q(d) somewhere); where rounding left
        # none, p itself stands in. Bonus rows draw from p.
        empty = residual.sum(dim=-1, keepdim=True) <= 0.0
        residual = torch.where(empty, probs, residual)
        fallback = residual.div_(noise).argmax(dim=-1)
        if greedy is not None:
            assert md.greedy_mask is not None
            accepted = torch.where(md.greedy_mask, is_draft & (row_draft == greedy), accepted)
            fallback = torch.where(md.greedy_mask, greedy, fallback)

    # First row of each request that is not an accepted draft: where it stops.
    width = int(max(num_drafts, default=0)) + 1
    stops = torch.ones(num_reqs, width, dtype=torch.bool, device=device)
    stops[row_req, row_pos] = ~accepted
    num_accepted = stops.int().argmax(dim=1)  # the first True
    row_tokens = torch.where(row_pos < num_accepted[row_req], row_draft, fallback)
    token_ids = torch.full((num_reqs, width), -1, dtype=torch.int64, device=device)
    emitted = row_pos <= num_accepted[row_req]
    token_ids[row_req, row_pos] = torch.where(emitted, row_tokens, -1)
    return RejectionOutput(token_ids=token_ids, num_emitted=num_accepted + 1,
                           row_tokens=row_tokens, processed_logits=processed)


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host int64 array on ``device``; on CUDA through pinned memory, so that the host
    does not wait for the kernels queued before the copy (a pageable copy would)."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _draws(probs: torch.Tensor, generators: dict[int, torch.Generator]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, a uniform in [0, 1) and vocab-wide Exponential(1) noise (clamped away from
    0); seeded rows from their own generator, the noise first: a row without a draft then
    draws exactly what the non-speculative sampler draws at its position, so a seeded
    request's tokens do not depend on whether a step verified drafts (which depends on
    the batch)."""
    rows, vocab = probs.shape
    noise = torch.empty_like(probs).exponential_()
    uniform = torch.rand(rows, device=probs.device)
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
        uniform[row] = torch.rand(1, device=probs.device, generator=generator)[0]
    return uniform, noise.clamp_(min=_TINY)
