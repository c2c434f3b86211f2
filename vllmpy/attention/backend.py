"""Attention backends over the paged KV cache.

A backend stores the step's new keys and values into the cache, then computes causal
attention of each request's new queries over all of that request's cached tokens.
The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim].

An fp8 cache (``torch.float8_e4m3fn``) holds ``clamp(x / scale, -448, 448)`` with one
scale for the layer's keys (``k_scale``) and one for its values (``v_scale``); reading
gives back ``page * scale`` in the compute dtype. Caches of any other dtype hold the
values as they are and ignore the scales.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vllmpy.attention.metadata import AttentionMetadata

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448: the largest finite e4m3 value


class AttentionBackend:
    """Contract: ``forward(q, k, v, kv_cache, meta, k_scale, v_scale, kv_stored)`` with q
    [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim]; writes
    k and v at ``meta.slot_mapping`` (quantized with the scales when the cache is fp8),
    unless ``kv_stored`` says the caller already has, and returns [num_tokens, num_heads,
    head_dim].

    Every backend takes the layer's attention features at construction:
    ``sliding_window`` (a query at position p sees the keys at positions p - window + 1
    .. p; None: all of them) and ``logit_softcap`` (scores become
    ``cap * tanh(scale * q.k / cap)`` before the softmax; None: no cap).

    ``sinks`` (GPT-OSS), given to ``forward`` as it is a learned parameter of the layer:
    [num_heads] logits, one per query head, that join every query's softmax denominator
    as one more column which weighs no value (softmax over [scores, sink], the sink's
    share dropped), so a query may give less than all of its attention to the keys.
    None: a plain softmax.

    ``fused_qkv`` is where a backend takes more of the attention block into its kernels:
    given the block (``vllmpy.layers.attention.SelfAttention``: its q/k norms, rotary
    embedding and head sizes) and the packed qkv projection, it returns the attention
    output [num_tokens, num_heads * head_dim], or None to let the block run its own steps
    (norms, rotary, then ``forward``). The default fuses nothing.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None,
                 logit_softcap: float | None = None) -> None:
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def fused_qkv(self, block: Any, qkv: torch.Tensor, positions: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor | None:
        return None


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """Refuse sinks that are not one floating value per query head."""
    if sinks is not None and (tuple(sinks.shape) != (num_heads,)
                              or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a floating [{num_heads}] tensor (one logit per "
                         f"query head), got {sinks.dtype} {tuple(sinks.shape)}")


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of float32 ``scores``, with ``sinks`` (float32,
    broadcast against ``scores[..., :1]``: one logit per row) joining each row's
    denominator; None: the plain softmax. A row whose keys are all hidden (-inf) gives
    zeros with a sink."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)  # finite, for the sink
    weights = (scores - top).exp_()
    return weights.div_(weights.sum(dim=-1, keepdim=True) + (sinks - top).exp())


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x in the cache's storage dtype: fp8 holds clamp(x / scale, +-448), others hold x."""
    if dtype != FP8_KV_DTYPE:
        return x if x.dtype == dtype else x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


# every e4m3 value, indexed by its byte
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()


def dequantize_kv(page: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached keys or values in the compute dtype: fp8 pages times their scale."""
    if page.dtype != FP8_KV_DTYPE:
        return page.to(dtype)
    # torch converts fp8 one element at a time on the CPU; looking each byte up in a
    # 256-entry table of (e4m3 value * scale) is several times faster and rounds once
    table = (_FP8_VALUES.to(page.device) * scale).to(dtype)
    return torch.take(table, page.view(torch.uint8).long())


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Store k and v ([num_tokens, num_kv_heads, head_dim]) into their slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k = quantize_kv(k, kv_cache.dtype, k_scale)
    v = quantize_kv(v, kv_cache.dtype, v_scale)
    if kv_cache.dtype == FP8_KV_DTYPE:
        # index_copy_ has no fp8 kernel on the CPU: copy the bytes
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, kv_heads, head_dim]
    flat.index_copy_(1, slot_mapping, torch.stack((k, v)))  # one copy for both


class TorchReferenceBackend(AttentionBackend):
    """Gathers each request's blocks and runs ``scaled_dot_product_attention``.

    Plain and slow, but easy to trust: the CPU path and the reference for kernels. With a
    sliding window a request's blocks are read from the one holding the first key its
    first query sees; with a softcap or sinks the scores are computed explicitly.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        check_sinks(sinks, self.num_heads)
        # [heads, 1, 1]: one logit per row of each head's scores
        head_sinks = None if sinks is None else sinks.float().view(-1, 1, 1)
        num_tokens = meta.num_actual_tokens
        if not kv_stored:
            write_kv_cache(k[:num_tokens], v[:num_tokens], kv_cache,
                           meta.slot_mapping[:num_tokens], k_scale, v_scale)
        scales = (k_scale, v_scale)
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        decode_rows = [i for i in range(meta.num_reqs) if starts[i + 1] - starts[i] == 1]
        if len(decode_rows) > 1:
            self._batched_decode(q, kv_cache, meta, decode_rows, out, scales, head_sinks)
        decode_set = set(decode_rows) if len(decode_rows) > 1 else set()
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            if i not in decode_set:
                self._one_request(q, kv_cache, meta, i, seq_len, out, scales, head_sinks)
        return out

    @staticmethod
    def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype,
                scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given blocks, [..., num_blocks * block_size, kv_heads, dim],
        in the compute dtype (fp8 pages dequantized with their (k_scale, v_scale))."""
        k_scale, v_scale = scales
        keys = dequantize_kv(kv_cache[0, blocks].flatten(-4, -3), dtype, k_scale)
        values = dequantize_kv(kv_cache[1, blocks].flatten(-4, -3), dtype, v_scale)
        return keys, values

    def _first_block(self, position: int, block_size: int) -> int:
        """The block holding the first key a query at ``position`` sees."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // block_size

    def _one_request(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     i: int, seq_len: int, out: torch.Tensor, scales: tuple[float, float],
                     sinks: torch.Tensor | None) -> None:
        q_start, q_end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        q_len = q_end - q_start
        num_blocks = -(-seq_len // meta.block_size)
        first = self._first_block(seq_len - q_len, meta.block_size)
        offset = first * meta.block_size  # the position of the first key gathered
        keys, values = self._gather(kv_cache, meta.block_tables[i, first:num_blocks].long(),
                                    q.dtype, scales)
        keys, values = keys[:seq_len - offset], values[:seq_len - offset]  # [keys, kvh, dim]
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        query = q[q_start:q_end].transpose(0, 1)  # [heads, q_len, head_dim]
        mask = None
        window = self.sliding_window
        if q_len > 1 or (window is not None and seq_len - window > offset):
            # query j sits at position seq_len - q_len + j and sees keys up to there
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = _visible(q_pos[:, None], torch.arange(offset, seq_len, device=q.device),
                            window)  # [q_len, keys]
        attn = self._attention(query, keys.transpose(0, 1), values.transpose(0, 1), mask,
                               sinks)
        out[q_start:q_end] = attn.transpose(0, 1)

    def _batched_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        rows: list[int], out: torch.Tensor, scales: tuple[float, float],
                        sinks: torch.Tensor | None) -> None:
        """Every one-token query of the step in one padded attention call."""
        lens = [meta.seq_lens_cpu[i] for i in rows]
        block = meta.block_size
        num_blocks = -(-max(lens) // block)
        idx = torch.tensor(rows, device=q.device)
        tokens = meta.query_start_loc[idx].long()  # the row of each request's one query
        firsts = None
        if self.sliding_window is None:
            blocks = meta.block_tables[idx, :num_blocks].long()  # [R, num_blocks]
        else:  # each row from the block holding its window's first key
            firsts = torch.tensor([self._first_block(n - 1, block) for n in lens],
                                  device=q.device)
            num_blocks = max(-(-n // block) - int(f) for n, f in zip(lens, firsts.tolist()))
            table = meta.block_tables[idx].long()
            cols = (firsts[:, None] + torch.arange(num_blocks, device=q.device))
            blocks = table.gather(1, cols.clamp_(max=table.shape[1] - 1))  # [R, num_blocks]
        keys, values = self._gather(kv_cache, blocks, q.dtype, scales)  # [R, L, kv_heads, dim]
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            keys = keys.repeat_interleave(group, dim=2)
            values = values.repeat_interleave(group, dim=2)
        positions = torch.arange(keys.shape[1], device=q.device)  # of each gathered key
        if firsts is not None:
            positions = firsts[:, None] * block + positions  # [R, L]
        q_pos = torch.tensor(lens, device=q.device)[:, None] - 1
        mask = _visible(q_pos, positions, self.sliding_window)[:, None, None, :]  # [R,1,1,L]
        query = q[tokens].unsqueeze(2)  # [R, heads, 1, head_dim]
        attn = self._attention(query, keys.transpose(1, 2), values.transpose(1, 2), mask,
                               sinks)
        out[tokens] = attn.squeeze(2)  # [R, heads, head_dim]

    def _attention(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """softmax(scores) @ values over [..., heads, len, head_dim] inputs, ``mask`` True
        where a query sees a key; the scores capped when the layer has a softcap, the
        ``sinks`` ([heads, 1, 1] float32) in the denominator when given."""
        cap = self.logit_softcap
        if cap is None and sinks is None:
            return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                  scale=self.scale)
        scores = query.float() @ keys.float().transpose(-1, -2) * self.scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (sink_softmax(scores, sinks) @ values.float()).to(query.dtype)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether queries at ``q_pos`` see keys at ``k_pos`` (broadcast together): keys at
    or before the query and, with a window, fewer than ``window`` positions before it."""
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask
