"""Bidirectional (non-causal) attention for encoder-only models, with no KV cache.

A pooling step holds every scheduled request's whole prompt (the scheduler never splits
a pooling request), so each sequence's keys and values are all in the step: each query
attends to every token of its own sequence and to no other.

Two paths, chosen by the device and by whether the model adds a score bias:

- CUDA without a bias (BERT, Nomic BERT, EmbeddingGemma on steps within its window):
  ``vllmpy.ops.encoder_attention.varlen_attention``, one Triton launch over the step's
  packed tokens, each program bounded to its own sequence by the step's cumulative
  starts (``step_seqlens``). No padding, no gathers, one kernel per layer.
- The CPU, and any device with a bias (MPNet's relative positions, EmbeddingGemma's
  symmetric window): the step's sequences are sorted by length and cut into groups whose
  padded size stays within a quarter of their real tokens (``PAD_SLACK``); each group is
  gathered into a [sequences, its longest, heads, head_dim] batch, attended with
  PyTorch's ``scaled_dot_product_attention`` under a key mask (plus the bias), and
  scattered back to the packed rows. One padded batch of mixed lengths would spend most
  of its work on padding (a step of 8- to 256-token sentences pads each to 256); the
  groups spend little, in a handful of calls. On CUDA, SDPA picks its fused kernels.

Models that add a bias build it in the step's full padded layout (``padded_layout``:
every sequence padded to the step's longest); each group takes its rows of it. The
layouts and the cumulative starts depend only on the step, so they are made once per
step and kept on the step's ``AttentionMetadata`` for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.ops.encoder_attention import varlen_attention

# A group's padded tokens may exceed its real tokens by this fraction.
PAD_SLACK = 0.25
# CUDA: SDPA's flash and memory-efficient kernels (and its math fallback). A pooling
# step's groups come in ever new shapes, and a backend that plans per shape (cuDNN's)
# would plan again at every step.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.MATH]


@dataclass
class PaddedLayout:
    """Where each token of some sequences sits in a padded batch of them."""

    num_seqs: int
    longest: int
    lengths: list[int]
    # [their tokens] int64: row of each token in the flattened [num_seqs * longest]
    flat_index: torch.Tensor
    # [num_seqs, 1, 1, longest] bool: the real keys of each sequence
    key_mask: torch.Tensor
    # [their tokens] int64: each token's row in the step's packed tokens
    rows: torch.Tensor | None = None
    # [num_seqs] int64: each sequence's index in the step (for a bias's rows)
    seqs: torch.Tensor | None = None


def _layout(starts: list[int], lengths: list[int], device: torch.device) -> PaddedLayout:
    longest = max(lengths, default=0)
    n = torch.tensor(lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), n)
    offset = torch.arange(int(n.sum())) - (torch.cumsum(n, 0) - n)[seq]
    rows = torch.tensor(starts)[seq] + offset
    mask = torch.arange(longest)[None, :] < n[:, None]
    return PaddedLayout(len(lengths), longest, lengths, (seq * longest + offset).to(device),
                        mask[:, None, None, :].to(device), rows.to(device))


def padded_layout(meta: AttentionMetadata, device: torch.device) -> PaddedLayout:
    """Every sequence of the step padded to the step's longest (made on the first call,
    then read from ``meta``): the layout a model's attention bias is built in."""
    layout = getattr(meta, "_padded_layout", None)
    if layout is None:
        starts = meta.query_start_loc_cpu
        lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
        layout = _layout(list(starts[:-1]), lengths, device)
        layout.rows = None  # every token, in the step's order
        meta._padded_layout = layout  # type: ignore[attr-defined]
    return layout


def length_groups(meta: AttentionMetadata, device: torch.device) -> list[PaddedLayout]:
    """The step's sequences in groups of similar length (see the module docstring)."""
    groups = getattr(meta, "_length_groups", None)
    if groups is not None:
        return groups
    starts = meta.query_start_loc_cpu
    lengths = np.diff(np.asarray(starts))
    order = np.argsort(lengths, kind="stable")
    cut: list[list[int]] = []
    real = 0
    for i in order:  # ascending: the newcomer is the group's longest
        n = int(lengths[i])
        if cut and n * (len(cut[-1]) + 1) <= (1 + PAD_SLACK) * (real + n):
            cut[-1].append(int(i))
            real += n
        else:
            cut.append([int(i)])
            real = n
    groups = []
    for members in cut:
        layout = _layout([starts[i] for i in members], [int(lengths[i]) for i in members],
                         device)
        layout.seqs = torch.tensor(members, device=device)
        groups.append(layout)
    meta._length_groups = groups  # type: ignore[attr-defined]
    return groups


def step_seqlens(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, int]:
    """The step's cumulative sequence starts as an int32 [num_seqs + 1] tensor on
    ``device`` and its longest sequence (made on the first call, then read from
    ``meta``): what ``varlen_attention`` takes."""
    cached = getattr(meta, "_cu_seqlens", None)
    if cached is None:
        starts = meta.query_start_loc_cpu
        longest = max((b - a for a, b in zip(starts[:-1], starts[1:])), default=0)
        cached = (torch.tensor(starts, dtype=torch.int32, device=device), longest)
        meta._cu_seqlens = cached  # type: ignore[attr-defined]
    return cached


def to_padded(x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    """The step's packed [num_tokens, *rest] -> padded [num_seqs, longest, *rest] (the
    layout's sequences), zeros past each sequence's end."""
    if layout.rows is not None:  # a group: its tokens, out of the step's
        x = x.index_select(0, layout.rows)
    out = x.new_zeros((layout.num_seqs * layout.longest, *x.shape[1:]))
    out.index_copy_(0, layout.flat_index, x)
    return out.view(layout.num_seqs, layout.longest, *x.shape[1:])


def from_padded(x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    """Padded [num_seqs, longest, *rest] -> the layout's tokens [tokens, *rest], in the
    order ``to_padded`` took them."""
    return x.reshape(layout.num_seqs * layout.longest, *x.shape[2:]).index_select(
        0, layout.flat_index)


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata, scale: float | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Non-causal attention of each sequence of the step over its own tokens.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    ``bias``: None or an additive score bias [num_seqs, num_heads, longest, longest] in
    the step's padded layout (``padded_layout(meta, ...)``). Returns [num_tokens,
    num_heads * head_dim].
    """
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    out = q.new_empty(q.shape[0], heads * dim)
    if q.is_cuda and bias is None:
        cu_seqlens, longest = step_seqlens(meta, q.device)
        varlen_attention(q, k, v, cu_seqlens, longest, scale=scale,
                         out=out.view(-1, heads, dim))
        return out
    for layout in length_groups(meta, q.device):
        # [seqs, heads, longest, dim]
        qp, kp, vp = (to_padded(t, layout).transpose(1, 2) for t in (q, k, v))
        if kv_heads != heads:
            kp = kp.repeat_interleave(heads // kv_heads, dim=1)
            vp = vp.repeat_interleave(heads // kv_heads, dim=1)
        n = layout.longest
        if bias is None:
            mask: torch.Tensor | None = None if min(layout.lengths) == n else layout.key_mask
        else:
            rows = bias.index_select(0, layout.seqs)[:, :, :n, :n]  # type: ignore[arg-type]
            mask = rows.to(q.dtype).masked_fill(~layout.key_mask, float("-inf"))
        if q.is_cuda:  # kernels built once, not a plan per new (batch, length) shape
            with sdpa_kernel(_CUDA_BACKENDS):
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
        assert layout.rows is not None
        out.index_copy_(0, layout.rows, from_padded(o.transpose(1, 2), layout).reshape(
            -1, heads * dim))
    return out
