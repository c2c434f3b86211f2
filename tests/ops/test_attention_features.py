"""Sliding windows, logit softcaps and attention sinks in the Triton attention kernels
(paged_attention and the one-launch decode_attention) against a dense attention written
here over explicit positions, and paged_attention_ref against the same.

The semantics are transformers' (Gemma-2/3, Mistral, GPT-OSS): the query at position p
sees the keys at positions k with k <= p and p - k < window; a score s = scale * q.k
becomes cap * tanh(s / cap) before the softmax; a head's sink is one more softmax column
that weighs no value.

Keys and values of the tiles a kernel must not visit (wholly before every window of a
request) are NaN in the cache: a kernel that loads one of those tiles spreads the NaN to
the output (a masked key's weight is 0, and 0 * NaN is NaN), so these tests also check
that the loops start at the window.

Without CUDA the kernels run under Triton's interpreter in fp32; with CUDA also in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from vllmpy.attention.metadata import AttentionMetadata  # noqa: E402
from vllmpy.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from vllmpy.layers.attention import SelfAttention  # noqa: E402
from vllmpy.layers.rotary import RotaryEmbedding  # noqa: E402
from vllmpy.ops import decode_attention as decode_mod  # noqa: E402
from vllmpy.ops.fused import rotary_embedding_ref  # noqa: E402
from vllmpy.ops.paged_attention import (  # noqa: E402
    FP8_KV_DTYPE,
    AttentionKernelConfig,
    default_config,
    paged_attention,
    paged_attention_ref,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
NAN = float("nan")


def dense_attention(q, positions, keys, values, scale, window=None, softcap=None,
                    sinks=None):
    """The oracle, in float64: q [n, heads, dim] at ``positions`` (n ints) over one
    request's keys and values [seq_len, kv_heads, dim] (key k at position k); ``sinks``
    [heads]: each head's extra softmax column."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    group = heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        seen = [k for k in range(keys.shape[0])
                if k <= p and (window is None or p - k < window)]
        for h in range(heads):
            k = keys[seen, h // group].double()  # [len(seen), dim]
            s = (k @ q[i, h].double()) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            w = s.softmax(0)
            if sinks is not None:
                w = torch.cat([s, sinks[h:h + 1].double()]).softmax(0)[:-1]
            out[i, h] = w @ values[seen, h // group].double()
    return out


def scatter_pages(dense, block_size, num_blocks, gen):
    """A random cache [2, num_blocks, block_size, kv_heads, dim] holding each request's
    dense (keys, values) in blocks scattered over the pool; returns (cache, block_tables)."""
    kv_heads, dim = dense[0][0].shape[1:]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-k.shape[0] // block_size) for k, _ in dense) + 1
    tables = torch.zeros(len(dense), width, dtype=torch.int32)
    for i, (k, v) in enumerate(dense):
        for pos in range(k.shape[0]):
            if pos % block_size == 0:
                tables[i, pos // block_size] = perm.pop()
            block = int(tables[i, pos // block_size])
            cache[0, block, pos % block_size] = k[pos]
            cache[1, block, pos % block_size] = v[pos]
    return cache, tables


def poison_before(cache, tables, i, end, block_size):
    """NaN into request i's cached keys and values at positions [0, end)."""
    for pos in range(end):
        cache[:, int(tables[i, pos // block_size]), pos % block_size] = NAN


def first_skippable(first_key, tile):
    """Positions before the tile holding ``first_key``: no kernel loop may load them."""
    return first_key // tile * tile


# ---- paged_attention ---------------------------------------------------------------------

def randn(*shape, gen, dtype=torch.float32):
    """Normal values that ``dtype`` holds exactly (kept in fp32), so the oracle sees the
    kernel's inputs."""
    return torch.randn(*shape, generator=gen).to(dtype).float()


def make_batch(reqs, heads, kv_heads, dim, block_size, q_gain=1.0, seed=0,
               dtype=torch.float32):
    """Dense keys and values per request (q_len, seq_len), their paged cache, queries
    (times q_gain: large scores for the softcap) and metadata, all values of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    dense = [(randn(s, kv_heads, dim, gen=gen, dtype=dtype),
              randn(s, kv_heads, dim, gen=gen, dtype=dtype)) for _, s in reqs]
    num_blocks = sum(-(-s // block_size) for _, s in reqs) + 3
    cache, tables = scatter_pages(dense, block_size, num_blocks, gen)
    starts = [0]
    for q_len, _ in reqs:
        starts.append(starts[-1] + q_len)
    q = (torch.randn(starts[-1], heads, dim, generator=gen) * q_gain).to(dtype).float()
    return dict(dense=dense, q=q, kv_cache=cache, block_tables=tables, starts=starts)


def dense_batch(batch, reqs, scale, window, softcap, sinks=None):
    out = torch.zeros(batch["q"].shape, dtype=torch.float64)
    starts = batch["starts"]
    for i, (q_len, seq_len) in enumerate(reqs):
        rows = slice(starts[i], starts[i + 1])
        keys, values = batch["dense"][i]
        out[rows] = dense_attention(batch["q"][rows], range(seq_len - q_len, seq_len), keys,
                                    values, scale, window, softcap, sinks)
    return out


def run_paged(batch, reqs, dtype, *, window=None, softcap=None, num_splits=None,
              config=None, max_query_len=None, poison=True, cache=None, k_scale=1.0,
              v_scale=1.0, sinks=None):
    """paged_attention, then paged_attention_ref, over the batch; the kernel's cache has
    the tiles before every request's window poisoned (when there is a window)."""
    dim = batch["q"].shape[-1]
    scale = 1 / math.sqrt(dim)
    max_query_len = max_query_len or max(q for q, _ in reqs)
    cache = batch["kv_cache"] if cache is None else cache
    args = dict(
        q=batch["q"].to(DEVICE, dtype),
        query_start_loc=torch.tensor(batch["starts"], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32, device=DEVICE),
        block_tables=batch["block_tables"].to(DEVICE))
    features = dict(sliding_window=window, logit_softcap=softcap,
                    sinks=None if sinks is None else sinks.to(DEVICE))
    kernel_cache = cache.clone()
    if window is not None and poison:
        tile = (config or default_config(max_query_len, batch["q"].shape[1], cache.shape[3],
                                         dim, cache.dtype == FP8_KV_DTYPE)).tile_n
        block_size = cache.shape[2]
        for i, (q_len, seq_len) in enumerate(reqs):
            # the request's first query sees back the furthest
            end = first_skippable(max(seq_len - q_len - window + 1, 0), tile)
            poison_before(kernel_cache, batch["block_tables"], i, end, block_size)
    if kernel_cache.dtype != FP8_KV_DTYPE:
        kernel_cache = kernel_cache.to(dtype)
    out = torch.full_like(args["q"], 7.0)
    paged_attention(out=out, kv_cache=kernel_cache.to(DEVICE), scale=scale,
                    max_query_len=max_query_len, max_seq_len=max(s for _, s in reqs),
                    num_splits=num_splits, config=config, k_scale=k_scale, v_scale=v_scale,
                    **args, **features)
    ref = paged_attention_ref(kv_cache=cache.to(DEVICE), scale=scale, k_scale=k_scale,
                              v_scale=v_scale, **args, **features)
    return out.cpu(), ref.cpu()


def assert_close(got, want, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


# A long decode, a chunk on a long cached context, a fresh prefill longer than the small
# windows, a short decode.
REQS = [(1, 150), (9, 140), (21, 21), (1, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,num_splits", [
    (1, 1),  # each query sees itself only
    (5, 3),
    (20, 1),  # no multiple of the block size
    (20, 3),
    (64, 3),  # one tile
    (200, 1),  # past every request: all keys
])
def test_sliding_window_over_a_mixed_batch_matches_dense_attention(dtype, window, num_splits):
    heads, kv_heads, dim, block_size = 4, 2, 32, 16
    batch = make_batch(REQS, heads, kv_heads, dim, block_size, seed=1, dtype=dtype)
    out, ref = run_paged(batch, REQS, dtype, window=window, num_splits=num_splits)
    want = dense_batch(batch, REQS, 1 / math.sqrt(dim), window, None)
    assert_close(ref, want, dtype)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("window,max_query_len", [(7, 1), (40, 64)])
def test_window_with_short_tiles_and_either_kernel_variant(window, max_query_len):
    # 16-key tiles (as many tiles to skip as blocks), 8-query blocks: the later query
    # blocks of one request start their loops at later tiles than the first
    reqs = [(1, 150), (20, 90), (11, 11)]
    batch = make_batch(reqs, 4, 2, 32, 16, seed=2)
    config = AttentionKernelConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1)
    out, _ = run_paged(batch, reqs, torch.float32, window=window, num_splits=2,
                       config=config, max_query_len=max_query_len)
    assert_close(out, dense_batch(batch, reqs, 1 / math.sqrt(32), window, None),
                 torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_softcap_over_large_scores_matches_dense_attention(dtype, num_splits):
    heads, kv_heads, dim, cap = 4, 2, 32, 10.0
    batch = make_batch(REQS, heads, kv_heads, dim, 16, q_gain=8.0, seed=3,
                       dtype=dtype)  # |s| up to ~40
    out, ref = run_paged(batch, REQS, dtype, softcap=cap, num_splits=num_splits)
    want = dense_batch(batch, REQS, 1 / math.sqrt(dim), None, cap)
    assert_close(ref, want, dtype)
    assert_close(out, want, dtype)
    uncapped = dense_batch(batch, REQS, 1 / math.sqrt(dim), None, None)
    assert (want - uncapped).abs().max() > 0.1  # the cap changes the answer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,window,num_splits", [
    (6, 2, 20, 1),  # a head group that is no power of two
    (8, 2, 33, 3),  # GQA 4, split-KV
    (2, 2, 150, 2),  # MHA, a window as long as the longest request
])
def test_window_and_softcap_together_with_gqa(dtype, heads, kv_heads, window, num_splits):
    dim, cap = 32, 20.0
    batch = make_batch(REQS, heads, kv_heads, dim, 16, q_gain=6.0, seed=4, dtype=dtype)
    out, ref = run_paged(batch, REQS, dtype, window=window, softcap=cap, num_splits=num_splits)
    want = dense_batch(batch, REQS, 1 / math.sqrt(dim), window, cap)
    assert_close(ref, want, dtype)
    assert_close(out, want, dtype)


def test_window_and_softcap_over_an_fp8_cache():
    k_scale, v_scale = 0.02, 0.05
    reqs = [(1, 150), (9, 40), (13, 13)]
    batch = make_batch(reqs, 4, 2, 32, 16, q_gain=3.0, seed=5)
    cache = batch["kv_cache"]
    fp8 = torch.stack([(cache[0] / k_scale).to(FP8_KV_DTYPE),
                       (cache[1] / v_scale).to(FP8_KV_DTYPE)])
    # the oracle reads what the pages hold: page * scale
    dequant = torch.stack([fp8[0].float() * k_scale, fp8[1].float() * v_scale])
    tables = batch["block_tables"]
    for i, (_, seq_len) in enumerate(reqs):
        pos = torch.arange(seq_len)
        pages = dequant[:, tables[i, pos // 16].long(), pos % 16]  # [2, seq_len, kv, dim]
        batch["dense"][i] = (pages[0], pages[1])
    out, ref = run_paged(batch, reqs, torch.float32, window=21, softcap=15.0, num_splits=2,
                         cache=fp8, k_scale=k_scale, v_scale=v_scale)
    want = dense_batch(batch, reqs, 1 / math.sqrt(32), 21, 15.0)
    assert_close(ref, want, torch.float32)
    assert_close(out, want, torch.float32)


def test_the_chosen_split_count_with_a_window_matches_dense_attention():
    # a long decode with a small window: the launcher sizes its splits to the window
    reqs = [(1, 700), (1, 300)]
    batch = make_batch(reqs, 4, 1, 32, 16, seed=6)
    out, _ = run_paged(batch, reqs, torch.float32, window=50)
    assert_close(out, dense_batch(batch, reqs, 1 / math.sqrt(32), 50, None), torch.float32)


def test_launchers_refuse_bad_windows_and_softcaps_by_name():
    reqs = [(1, 5)]
    batch = make_batch(reqs, 4, 2, 32, 16)
    for window in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
            run_paged(batch, reqs, torch.float32, window=window, poison=False)
    for cap in (0.0, -1.0, NAN, float("inf")):
        with pytest.raises(ValueError, match="logit_softcap must be a positive finite"):
            run_paged(batch, reqs, torch.float32, softcap=cap)


def test_triton_backend_passes_the_layer_features_to_the_kernels():
    heads, kv_heads, dim, bs, window, cap = 4, 2, 32, 16, 12, 8.0
    reqs = [(1, 70), (6, 22), (5, 5)]
    batch = make_batch(reqs, heads, kv_heads, dim, bs, q_gain=5.0, seed=7)
    starts = batch["starts"]
    # the step's new keys and values: the last q_len of each request's dense ones
    new_k = torch.cat([k[s - q:] for (q, s), (k, _) in zip(reqs, batch["dense"])])
    new_v = torch.cat([v[s - q:] for (q, s), (_, v) in zip(reqs, batch["dense"])])
    slots = []
    for i, (q_len, seq_len) in enumerate(reqs):
        table = batch["block_tables"][i].tolist()
        slots += [table[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
    meta = AttentionMetadata(
        num_actual_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        query_start_loc_cpu=starts,
        seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32, device=DEVICE),
        seq_lens_cpu=[s for _, s in reqs],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=batch["block_tables"].to(DEVICE), block_size=bs)
    backend = TritonAttentionBackend(heads, kv_heads, dim, 1 / math.sqrt(dim),
                                     sliding_window=window, logit_softcap=cap)
    out = backend.forward(batch["q"].to(DEVICE), new_k.to(DEVICE), new_v.to(DEVICE),
                          batch["kv_cache"].clone().to(DEVICE), meta)
    assert_close(out.cpu(), dense_batch(batch, reqs, 1 / math.sqrt(dim), window, cap),
                 torch.float32)


# ---- decode_attention --------------------------------------------------------------------

# a long decode, a request whose only key is its new token, a padding row (seq_len 0),
# lengths at and around tile boundaries
SEQ_LENS = [150, 1, 0, 65, 97]


def make_step(seq_lens, heads, kv_heads, dim, block_size, q_gain=1.0, seed=0,
              dtype=torch.float32):
    """A decode step: one token per request, its earlier keys and values in a random
    cache, the new token's q, k, v packed in qkv (before rotary), values of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    dense = [(randn(max(s, 1), kv_heads, dim, gen=gen, dtype=dtype),
              randn(max(s, 1), kv_heads, dim, gen=gen, dtype=dtype)) for s in seq_lens]
    num_blocks = sum(-(-max(s, 1) // block_size) for s in seq_lens) + 2
    cache, tables = scatter_pages(dense, block_size, num_blocks, gen)
    slots = []
    for i, s in enumerate(seq_lens):
        last = max(s - 1, 0)
        slots.append(-1 if s == 0 else int(tables[i, last // block_size]) * block_size
                     + last % block_size)
    q = (torch.randn(len(seq_lens), heads * dim, generator=gen) * q_gain).to(dtype).float()
    new_k = randn(len(seq_lens), kv_heads * dim, gen=gen, dtype=dtype)
    new_v = randn(len(seq_lens), kv_heads * dim, gen=gen, dtype=dtype)
    return dict(dense=dense, cache=cache, tables=tables, q=q, k=new_k, v=new_v,
                slots=slots, seq_lens=seq_lens,
                cos_sin=RotaryEmbedding(dim, 4096, 10000.0).cos_sin_cache(torch.device("cpu")))


def dense_step(step, heads, kv_heads, dim, window, softcap, sinks=None):
    """The oracle for a decode step: rotary on q and the new k, then dense attention of
    each request's query (at seq_len - 1) over its cached keys and the new one."""
    positions = torch.tensor([max(s - 1, 0) for s in step["seq_lens"]])
    q, k = rotary_embedding_ref(positions, step["q"], step["k"], step["cos_sin"], dim)
    q, k = q.view(-1, heads, dim), k.view(-1, kv_heads, dim)
    v = step["v"].view(-1, kv_heads, dim)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, s in enumerate(step["seq_lens"]):
        if s == 0:
            continue
        keys, values = step["dense"][i]
        keys = torch.cat([keys[:s - 1], k[i:i + 1]])
        values = torch.cat([values[:s - 1], v[i:i + 1]])
        out[i:i + 1] = dense_attention(q[i:i + 1], [s - 1], keys, values, 1 / math.sqrt(dim),
                                       window, softcap, sinks)
    return out


def run_decode(step, heads, kv_heads, dim, dtype, *, window=None, softcap=None,
               num_splits=None, min_tiles=1, sinks=None):
    cache = step["cache"].clone()
    if window is not None:
        # tiles of either tile length the kernel takes, before the window: never loaded
        tile = max(decode_mod.TILE_N, decode_mod.SPLIT_TILE_N)
        for i, s in enumerate(step["seq_lens"]):
            end = first_skippable(max(s - window, 0), tile)
            poison_before(cache, step["tables"], i, end, cache.shape[2])
    cache = cache.to(DEVICE, dtype)
    n = len(step["seq_lens"])
    positions = torch.tensor([max(s - 1, 0) for s in step["seq_lens"]], device=DEVICE)
    qkv = torch.cat([step["q"], step["k"], step["v"]], dim=1).to(DEVICE, dtype)
    features = {}
    if window is not None:
        features["sliding_window"] = window
    if softcap is not None:
        features["logit_softcap"] = softcap
    assert decode_mod.supports(dim, cache, dtype, **features)
    out = decode_mod.decode_attention(
        qkv, positions, step["cos_sin"].to(DEVICE), cache,
        torch.tensor(step["slots"], dtype=torch.int64, device=DEVICE),
        torch.tensor(step["seq_lens"], dtype=torch.int32, device=DEVICE),
        step["tables"].to(DEVICE), num_heads=heads, scale=1 / math.sqrt(dim),
        max_seq_len=max(step["seq_lens"]), num_splits=num_splits,
        min_tiles_per_split=min_tiles, sinks=None if sinks is None else sinks.to(DEVICE),
        **features)
    assert out.shape == (n, heads, dim)
    return out.cpu(), cache.cpu()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap,num_splits,min_tiles", [
    (20, None, 1, 1),  # a window that is no block multiple, one program per request
    (20, None, 4, 1),  # split-KV over the window only
    (37, None, 3, 2),
    (1, None, 3, 1),  # the new token alone
    (500, None, 4, 1),  # a window past every request
    (None, 10.0, 1, 1),
    (None, 10.0, 3, 1),
    (33, 10.0, 3, 1),
])
def test_decode_attention_with_features_matches_dense_attention(
        dtype, window, softcap, num_splits, min_tiles):
    heads, kv_heads, dim = 4, 1, 32
    # large scores where the cap has something to cut
    step = make_step(SEQ_LENS, heads, kv_heads, dim, 16, q_gain=1.0 if softcap is None else 6.0,
                     seed=8, dtype=dtype)
    out, cache = run_decode(step, heads, kv_heads, dim, dtype, window=window, softcap=softcap,
                            num_splits=num_splits, min_tiles=min_tiles)
    want = dense_step(step, heads, kv_heads, dim, window, softcap)
    live = [i for i, s in enumerate(SEQ_LENS) if s > 0]
    assert_close(out[live], want[live], dtype)


def test_decode_attention_of_a_long_request_with_a_small_window():
    # 1,000 keys, a 40-key window, the split count fixed as a CUDA graph replay fixes it
    # and the one the launcher chooses: only the window's tiles are read
    heads, kv_heads, dim = 4, 1, 32
    step = make_step([1000, 45], heads, kv_heads, dim, 16, seed=9)
    want = dense_step(step, heads, kv_heads, dim, 40, None)
    for num_splits in (8, None):
        out, _ = run_decode(step, heads, kv_heads, dim, torch.float32, window=40,
                            num_splits=num_splits)
        assert_close(out, want, torch.float32)


def test_decode_attention_refuses_bad_features_by_name():
    heads, kv_heads, dim = 4, 2, 32
    step = make_step([5, 9], heads, kv_heads, dim, 16)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        run_decode(step, heads, kv_heads, dim, torch.float32, window=0)
    with pytest.raises(ValueError, match="logit_softcap must be a positive finite"):
        run_decode(step, heads, kv_heads, dim, torch.float32, softcap=-2.0)


def test_the_backend_decodes_with_the_layer_features_in_one_launch():
    heads, kv_heads, dim, bs, window, cap = 4, 2, 32, 16, 30, 10.0
    seq_lens = [90, 12]
    step = make_step(seq_lens, heads, kv_heads, dim, bs, q_gain=6.0, seed=10)
    backend = TritonAttentionBackend(heads, kv_heads, dim, 1 / math.sqrt(dim),
                                     sliding_window=window, logit_softcap=cap, num_splits=2)
    block = SelfAttention(16, heads, kv_heads, dim, rotary=RotaryEmbedding(dim, 4096, 10000.0))
    n = len(seq_lens)
    meta = AttentionMetadata(
        num_actual_tokens=n, query_start_loc=torch.arange(n + 1, dtype=torch.int32,
                                                          device=DEVICE),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        seq_lens_cpu=seq_lens,
        slot_mapping=torch.tensor(step["slots"], dtype=torch.int64, device=DEVICE),
        block_tables=step["tables"].to(DEVICE), block_size=bs, max_query_len=1,
        max_seq_len=max(seq_lens))
    qkv = torch.cat([step["q"], step["k"], step["v"]], dim=1).to(DEVICE)
    positions = torch.tensor([s - 1 for s in seq_lens], device=DEVICE)
    out = backend.fused_qkv(block, qkv, positions, step["cache"].clone().to(DEVICE), meta)
    assert out is not None  # the one-launch decode took the features
    want = dense_step(step, heads, kv_heads, dim, window, cap)
    assert_close(out.cpu().view(n, heads, dim), want, torch.float32)


# ---- attention sinks ---------------------------------------------------------------------

def make_sinks(heads, seed):
    """One sink logit per query head, around 1.5: a real share of each softmax (the
    scores of these tests are of order 1)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(heads, generator=gen) + 1.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,window,softcap,num_splits", [
    (4, 2, None, None, 1),
    (4, 2, None, None, 3),  # split-KV: the sink enters once, in split 0's partial
    (8, 2, 20, None, 1),  # GQA 4 with a window
    (8, 2, 20, None, 3),
    (6, 2, 33, None, 2),  # a head group that is no power of two
    (4, 4, 5, 10.0, 3),  # MHA, a window and a softcap
])
def test_sinks_over_a_mixed_batch_match_dense_attention(dtype, heads, kv_heads, window,
                                                        softcap, num_splits):
    dim = 32
    batch = make_batch(REQS, heads, kv_heads, dim, 16, q_gain=1.0 if softcap is None else 5.0,
                       seed=11, dtype=dtype)
    sinks = make_sinks(heads, 12)
    out, ref = run_paged(batch, REQS, dtype, window=window, softcap=softcap,
                         num_splits=num_splits, sinks=sinks)
    want = dense_batch(batch, REQS, 1 / math.sqrt(dim), window, softcap, sinks)
    assert_close(ref, want, dtype)
    assert_close(out, want, dtype)
    without = dense_batch(batch, REQS, 1 / math.sqrt(dim), window, softcap)
    assert (want - without).abs().max() > 0.05  # the sinks change the answer


def test_sinks_with_short_tiles_in_either_kernel_variant():
    reqs = [(1, 150), (20, 90), (11, 11)]
    batch = make_batch(reqs, 8, 2, 32, 16, seed=13)
    sinks = make_sinks(8, 14)
    config = AttentionKernelConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1)
    for max_query_len, window in ((1, 7), (64, None)):
        out, _ = run_paged(batch, reqs, torch.float32, window=window, num_splits=2,
                           config=config, max_query_len=max_query_len, sinks=sinks)
        assert_close(out, dense_batch(batch, reqs, 1 / math.sqrt(32), window, None, sinks),
                     torch.float32)


def test_launchers_refuse_bad_sinks_by_name():
    reqs = [(1, 5)]
    batch = make_batch(reqs, 4, 2, 32, 16)
    for bad in (torch.zeros(3, device=DEVICE), torch.zeros(4, dtype=torch.int32, device=DEVICE),
                torch.zeros(8, device=DEVICE)[::2]):
        with pytest.raises(ValueError, match=r"sinks must be a contiguous float \[4\]"):
            run_paged(batch, reqs, torch.float32, sinks=bad)
    step = make_step([5, 9], 4, 2, 32, 16)
    with pytest.raises(ValueError, match=r"sinks must be a contiguous float \[4\]"):
        run_decode(step, 4, 2, 32, torch.float32, sinks=torch.zeros(2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap,num_splits,min_tiles", [
    (None, None, 1, 1),
    (None, None, 4, 1),  # split-KV, the merge
    (20, None, 4, 1),  # split-KV over a window
    (37, None, 3, 2),
    (1, None, 3, 1),  # the new token alone beside the sink
    (33, 10.0, 1, 1),
])
def test_decode_attention_with_sinks_matches_dense_attention(dtype, window, softcap,
                                                             num_splits, min_tiles):
    heads, kv_heads, dim = 8, 2, 32  # GQA 4
    step = make_step(SEQ_LENS, heads, kv_heads, dim, 16, q_gain=1.0 if softcap is None else 6.0,
                     seed=15, dtype=dtype)
    sinks = make_sinks(heads, 16)
    out, _ = run_decode(step, heads, kv_heads, dim, dtype, window=window, softcap=softcap,
                        num_splits=num_splits, min_tiles=min_tiles, sinks=sinks)
    want = dense_step(step, heads, kv_heads, dim, window, softcap, sinks)
    live = [i for i, s in enumerate(SEQ_LENS) if s > 0]
    assert_close(out[live], want[live], dtype)


def _meta(reqs, tables, bs, slots, decode=False):
    starts = [0]
    for q_len, _ in reqs:
        starts.append(starts[-1] + q_len)
    seq_lens = [s for _, s in reqs]
    return AttentionMetadata(
        num_actual_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        query_start_loc_cpu=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        seq_lens_cpu=seq_lens,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=tables.to(DEVICE), block_size=bs,
        max_query_len=1 if decode else 0, max_seq_len=max(seq_lens) if decode else 0)


def test_the_backend_takes_a_blocks_sinks_on_every_path():
    """TritonAttentionBackend with a block's sinks: a mixed step through forward (the
    block's own norms and rotary, then paged_attention) and a decode step through the
    one-launch decode_attention."""
    heads, kv_heads, dim, bs, window = 8, 2, 32, 16, 25
    sinks = make_sinks(heads, 17)
    block = SelfAttention(16, heads, kv_heads, dim, rotary=RotaryEmbedding(dim, 4096, 10000.0),
                          sinks=True)
    block.sinks.data = sinks.to(DEVICE)
    backend = TritonAttentionBackend(heads, kv_heads, dim, 1 / math.sqrt(dim),
                                     sliding_window=window, num_splits=2)
    # a mixed step: the block's unfused path hands the sinks to forward
    reqs = [(1, 70), (6, 22), (5, 5)]
    batch = make_batch(reqs, heads, kv_heads, dim, bs, seed=18)
    new_k = torch.cat([k[s - q:] for (q, s), (k, _) in zip(reqs, batch["dense"])])
    new_v = torch.cat([v[s - q:] for (q, s), (_, v) in zip(reqs, batch["dense"])])
    slots = []
    for i, (q_len, seq_len) in enumerate(reqs):
        table = batch["block_tables"][i].tolist()
        slots += [table[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
    out = backend.forward(batch["q"].to(DEVICE), new_k.to(DEVICE), new_v.to(DEVICE),
                          batch["kv_cache"].clone().to(DEVICE),
                          _meta(reqs, batch["block_tables"], bs, slots), sinks=block.sinks)
    assert_close(out.cpu(), dense_batch(batch, reqs, 1 / math.sqrt(dim), window, None, sinks),
                 torch.float32)
    # a decode step: fused_qkv reads the block's sinks
    seq_lens = [90, 12]
    step = make_step(seq_lens, heads, kv_heads, dim, bs, seed=19)
    qkv = torch.cat([step["q"], step["k"], step["v"]], dim=1).to(DEVICE)
    positions = torch.tensor([s - 1 for s in seq_lens], device=DEVICE)
    meta = _meta([(1, s) for s in seq_lens], step["tables"], bs, step["slots"], decode=True)
    out = backend.fused_qkv(block, qkv, positions, step["cache"].clone().to(DEVICE), meta)
    assert out is not None  # the one-launch decode took the sinks
    want = dense_step(step, heads, kv_heads, dim, window, None, sinks)
    assert_close(out.cpu().view(len(seq_lens), heads, dim), want, torch.float32)
