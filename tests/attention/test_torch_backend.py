"""The reference paged-attention backend against plain causal attention on whole sequences."""

from __future__ import annotations

import math

import pytest
import torch

from vllmpy.attention.backend import TorchReferenceBackend, write_kv_cache
from vllmpy.attention.metadata import AttentionMetadata


def naive_causal(q, k, v, scale):
    """q [T, H, D], k/v [T, KH, D] of one whole sequence -> [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    t = q.shape[0]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


REQUESTS = {
    # (total length, tokens already cached, blocks)
    "decode, chunk after context, prefill": [(9, 8, [7, 3, 11]), (13, 5, [0, 20, 5, 9]),
                                             (6, 0, [30, 31])],
    # several one-token queries take the batched decode path
    "batched decodes and a chunk": [(9, 8, [7, 3, 11]), (14, 13, [0, 20, 5, 9]),
                                    (2, 1, [30]), (13, 5, [12, 13, 14, 15]),
                                    (5, 4, [16, 17])],
}


@pytest.mark.parametrize("case", sorted(REQUESTS))
def test_chunks_over_cached_context_match_whole_sequence_attention(case):
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, num_blocks = 4, 2, 16, 4, 32
    scale = 1 / math.sqrt(dim)
    backend = TorchReferenceBackend(heads, kv_heads, dim, scale)
    cache = torch.zeros(2, num_blocks, bs, kv_heads, dim)
    reqs = REQUESTS[case]
    full = [(torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim),
             torch.randn(n, kv_heads, dim)) for n, _, _ in reqs]

    def slots(blocks, positions):
        return [blocks[p // bs] * bs + p % bs for p in positions]

    # the cached context is written beforehand, as earlier steps would have
    for (_n, ctx, blocks), (_, k, v) in zip(reqs, full):
        if ctx:
            write_kv_cache(k[:ctx], v[:ctx], cache, torch.tensor(slots(blocks, range(ctx))))
    q_new = torch.cat([q[ctx:] for (n, ctx, _), (q, _, _) in zip(reqs, full)])
    k_new = torch.cat([k[ctx:] for (n, ctx, _), (_, k, _) in zip(reqs, full)])
    v_new = torch.cat([v[ctx:] for (n, ctx, _), (_, _, v) in zip(reqs, full)])
    starts = [0]
    for n, ctx, _ in reqs:
        starts.append(starts[-1] + n - ctx)
    table = torch.zeros(len(reqs), 4, dtype=torch.int32)
    for i, (_, _, blocks) in enumerate(reqs):
        table[i, :len(blocks)] = torch.tensor(blocks)
    meta = AttentionMetadata(
        num_actual_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32), query_start_loc_cpu=starts,
        seq_lens=torch.tensor([n for n, _, _ in reqs], dtype=torch.int32),
        seq_lens_cpu=[n for n, _, _ in reqs],
        slot_mapping=torch.tensor(sum((slots(b, range(c, n)) for n, c, b in reqs), [])),
        block_tables=table, block_size=bs)
    out = backend.forward(q_new, k_new, v_new, cache, meta)
    for i, ((_n, ctx, _), (q, k, v)) in enumerate(zip(reqs, full)):
        expected = naive_causal(q, k, v, scale)[ctx:]
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], expected, atol=1e-5, rtol=1e-5)
