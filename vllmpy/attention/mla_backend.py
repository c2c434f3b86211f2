"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged latent cache.

A layer's cache is one tensor [num_blocks, block_size, kv_lora_rank + rope_dim]
(``vllmpy.core.cache_spec.MLASpec``): per token, the normalised latent ``c_kv`` and the
rotated key ``k_pe`` that every head shares. The keys and values of head h are the
up-projections of the latent through ``kv_b_proj`` ([H * (nope + v), kv_lora_rank]):
``k_nope[h] = W_UK[h] c_kv`` and ``v[h] = W_UV[h] c_kv``, and the key is ``[k_nope[h],
k_pe]``. Two ways compute the same attention:

- *expanded* (prefill): up-project the request's latents into per-head keys and values
  and run causal attention with head dim nope + rope (what transformers computes);
- *absorbed* (decode): take the query into the latent space, ``q_lat[h] = W_UK[h]^T
  q_nope[h]``, so the score is ``q_lat . c_kv + q_pe . k_pe`` over the cached rows
  themselves; the output ``W_UV[h] (sum_t p_t c_kv[t])`` comes out through W_UV once per
  query, not once per cached token.

An fp8 cache (``torch.float8_e4m3fn``) holds ``clamp(row / kv_scale, +-448)`` with one
scale per layer (1.0 unless a caller sets one), as ``vllmpy.attention.backend`` stores
keys and values; reading gives ``page * kv_scale`` in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vllmpy.attention.backend import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from vllmpy.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class MLADims:
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class UpProjection:
    """A layer's latent-to-head projections: ``kv_b_proj`` (the layer's linear layer, any
    quantization method; [.., kv_lora_rank] -> [.., H * (nope + v)]) for the expanded
    path, and its weight split per head for the absorbed one: ``w_uk`` [H, nope,
    kv_lora_rank] and ``w_uv`` [H, kv_lora_rank, v] (transposed for the matmul)."""

    kv_b_proj: Any
    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @classmethod
    @torch.no_grad()
    def of(cls, kv_b_proj: Any, dims: MLADims, dtype: torch.dtype,
           device: torch.device) -> UpProjection:
        """Read the per-head matrices out of ``kv_b_proj`` by running it on the identity
        (so a quantized layer gives its effective weight)."""
        eye = torch.eye(dims.kv_lora_rank, dtype=dtype, device=device)
        w = kv_b_proj(eye).view(dims.kv_lora_rank, dims.num_heads,
                                dims.qk_nope_head_dim + dims.v_head_dim)  # [L, H, N + V]
        w_uk = w[:, :, :dims.qk_nope_head_dim].permute(1, 2, 0).contiguous()  # [H, N, L]
        w_uv = w[:, :, dims.qk_nope_head_dim:].permute(1, 0, 2).contiguous()  # [H, L, V]
        return cls(kv_b_proj, w_uk, w_uv)

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] -> q_lat [T, H, kv_lora_rank] (a view)."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def values(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [T, H, kv_lora_rank] -> [T, H, v] (a view)."""
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv).transpose(0, 1)


class MLABackend:
    """Contract: ``forward(q_nope, q_pe, c_kv, k_pe, kv_cache, meta, up, kv_scale)`` with
    q_nope [T, H, nope], q_pe [T, H, rope] (rotated), c_kv [T, kv_lora_rank] (normalised)
    and k_pe [T, rope] (rotated); stores the first ``meta.num_actual_tokens`` tokens' rows
    at ``meta.slot_mapping`` and returns the attention output [T, H, v] of every query
    over its request's cached rows (rows past the actual tokens are unspecified)."""

    def __init__(self, dims: MLADims, scale: float) -> None:
        self.dims = dims
        self.scale = scale

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                k_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                up: UpProjection, kv_scale: float = 1.0) -> torch.Tensor:
        raise NotImplementedError


def write_latent_rows(c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_scale: float = 1.0) -> None:
    """Store [c_kv, k_pe] rows ([T, kv_lora_rank], [T, rope]) at their slots."""
    rows = quantize_kv(torch.cat([c_kv, k_pe], dim=-1), kv_cache.dtype, kv_scale)
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [num_slots, latent_dim]
    if kv_cache.dtype == FP8_KV_DTYPE:  # index_copy_ has no fp8 kernel on the CPU
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slot_mapping.long(), rows)


def gather_latents(kv_cache: torch.Tensor, blocks: torch.Tensor, length: int,
                   dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """The first ``length`` rows of the blocks ``blocks`` ([..., num_blocks]) as
    [..., length, latent_dim] in ``dtype`` (fp8 pages dequantized)."""
    rows = kv_cache[blocks].flatten(-3, -2)[..., :length, :]
    return dequantize_kv(rows, dtype, kv_scale)


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor,
                       up: UpProjection, dims: MLADims, scale: float) -> torch.Tensor:
    """Causal attention of one request's queries (q_nope [Q, H, nope], q_pe [Q, H, rope],
    the last Q of its tokens) over its rows ``latents`` [S, latent_dim], the keys and
    values up-projected through ``kv_b_proj``: [Q, H, v]."""
    s, q_len = latents.shape[0], q_nope.shape[0]
    c_kv, k_pe = latents.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
    kv = up.kv_b_proj(c_kv).view(s, dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim)
    k_nope, v = kv.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
    keys = torch.cat([k_nope, k_pe[:, None, :].expand(-1, dims.num_heads, -1)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1)  # [Q, H, nope + rope]
    mask = None
    if q_len != s:  # query j at position s - q_len + j sees the rows up to there
        q_pos = torch.arange(s - q_len, s, device=latents.device)
        mask = q_pos[:, None] >= torch.arange(s, device=latents.device)[None, :]
    out = F.scaled_dot_product_attention(  # [H, Q, v]
        query.transpose(0, 1), keys.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        is_causal=mask is None and q_len > 1, scale=scale)
    return out.transpose(0, 1)


def decode_rows(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(requests with one query, requests with more) of the step, from the host copies."""
    starts = meta.query_start_loc_cpu
    ones, longer = [], []
    for i in range(meta.num_reqs):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            ones.append(i)
        elif q_len > 1:
            longer.append(i)
    return ones, longer


class TorchMLABackend(MLABackend):
    """The CPU path, and the reference for the kernels: requests with one query take the
    absorbed path, in one batch padded to the longest of them; longer ones the expanded
    path, one request at a time (``scaled_dot_product_attention``). Scores and softmax
    of the absorbed path run in float32."""

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                k_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                up: UpProjection, kv_scale: float = 1.0) -> torch.Tensor:
        n = meta.num_actual_tokens
        write_latent_rows(c_kv[:n], k_pe[:n], kv_cache, meta.slot_mapping[:n], kv_scale)
        dims = self.dims
        out = q_nope.new_empty(q_nope.shape[0], dims.num_heads, dims.v_head_dim)
        ones, longer = decode_rows(meta)
        starts = meta.query_start_loc_cpu
        if ones:
            tokens = torch.tensor([starts[i] for i in ones], device=q_nope.device)
            out[tokens] = self._absorbed(q_nope[tokens], q_pe[tokens], kv_cache, meta,
                                         ones, up, kv_scale)
        for i in longer:
            seq_len = meta.seq_lens_cpu[i]
            blocks = meta.block_tables[i, :-(-seq_len // meta.block_size)].long()
            latents = gather_latents(kv_cache, blocks, seq_len, q_nope.dtype, kv_scale)
            rows = slice(starts[i], starts[i + 1])
            out[rows] = expanded_attention(q_nope[rows], q_pe[rows], latents, up, dims,
                                           self.scale)
        return out

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, reqs: list[int], up: UpProjection,
                  kv_scale: float) -> torch.Tensor:
        """One-query requests ``reqs`` (their queries [R, H, ...]) -> [R, H, v]."""
        lens = [meta.seq_lens_cpu[i] for i in reqs]
        longest, dev = max(lens), q_nope.device
        idx = torch.tensor(reqs, device=dev)
        blocks = meta.block_tables[idx, :-(-longest // meta.block_size)].long()
        rows = gather_latents(kv_cache, blocks, longest, torch.float32, kv_scale)  # [R, S, D]
        query = torch.cat([up.absorb(q_nope), q_pe], dim=-1).float()  # [R, H, D]
        scores = torch.bmm(query, rows.transpose(1, 2)).mul_(self.scale)  # [R, H, S]
        past_end = (torch.arange(longest, device=dev)[None, :]
                    >= torch.tensor(lens, device=dev)[:, None])  # [R, S]
        scores.masked_fill_(past_end[:, None, :], float("-inf"))
        o_lat = torch.bmm(scores.softmax(-1), rows[..., :self.dims.kv_lora_rank])  # [R, H, L]
        return up.values(o_lat.to(q_nope.dtype))
