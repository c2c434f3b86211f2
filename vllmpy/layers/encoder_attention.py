"""Bidirectional (non-causal) attention for encoder-only models, with no KV cache.

A pooling step holds every scheduled request's whole prompt (the scheduler never splits
a pooling request), so each sequence's keys and values are all in the step: each query
attends to every token of its own sequence and to no other. The packed tokens are
gathered into a [sequences, longest, heads, head_dim] batch, attended with PyTorch's
``scaled_dot_product_attention`` under a key mask (plus an additive bias where the model
has one, MPNet's relative-position bias), and scattered back to the packed rows. The
same code runs on the CPU and on CUDA, where SDPA picks its fused kernels.

The gather index depends only on the step, so it is made once per step and kept on the
step's ``AttentionMetadata`` for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllmpy.attention.metadata import AttentionMetadata


@dataclass
class PaddedLayout:
    """Where each packed token sits in the padded batch."""

    num_seqs: int
    longest: int
    lengths: list[int]
    # [num_tokens] int64: row of each packed token in the flattened [num_seqs * longest]
    flat_index: torch.Tensor
    # [num_seqs, 1, 1, longest] bool: the real keys of each sequence
    key_mask: torch.Tensor


def padded_layout(meta: AttentionMetadata, device: torch.device) -> PaddedLayout:
    """The step's padded layout (made on the first call, then read from ``meta``)."""
    layout = getattr(meta, "_padded_layout", None)
    if layout is not None:
        return layout
    starts = meta.query_start_loc_cpu
    lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
    longest = max(lengths, default=0)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    offset = torch.arange(int(sum(lengths))) - torch.tensor(starts[:-1])[seq]
    flat = (seq * longest + offset).to(device)
    mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).to(device)
    layout = PaddedLayout(len(lengths), longest, lengths, flat, mask[:, None, None, :])
    meta._padded_layout = layout  # type: ignore[attr-defined]
    return layout


def to_padded(x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    """Packed [num_tokens, *rest] -> padded [num_seqs, longest, *rest] (zeros past each
    sequence's end)."""
    out = x.new_zeros((layout.num_seqs * layout.longest, *x.shape[1:]))
    out.index_copy_(0, layout.flat_index, x)
    return out.view(layout.num_seqs, layout.longest, *x.shape[1:])


def from_padded(x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    """Padded [num_seqs, longest, *rest] -> packed [num_tokens, *rest]."""
    return x.reshape(layout.num_seqs * layout.longest, *x.shape[2:]).index_select(
        0, layout.flat_index)


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata, scale: float | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Non-causal attention of each sequence of the step over its own tokens.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    ``bias``: None or an additive score bias [num_seqs, num_heads, longest, longest] in
    the padded layout (``padded_layout(meta, ...)``). Returns [num_tokens, num_heads *
    head_dim]. Softmax is taken in float32 when the inputs are narrower (SDPA's math on
    the CPU; its fused CUDA kernels accumulate in float32 themselves).
    """
    layout = padded_layout(meta, q.device)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    # [seqs, heads, longest, dim]
    qp, kp, vp = (to_padded(t, layout).transpose(1, 2) for t in (q, k, v))
    if kv_heads != heads:
        kp = kp.repeat_interleave(heads // kv_heads, dim=1)
        vp = vp.repeat_interleave(heads // kv_heads, dim=1)
    if bias is None:
        mask: torch.Tensor = layout.key_mask
    else:
        mask = bias.to(q.dtype).masked_fill(~layout.key_mask, float("-inf"))
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
    return from_padded(out.transpose(1, 2), layout).reshape(-1, heads * dim)
