"""The CPU attention backend against the reference backend on random paged inputs."""

from __future__ import annotations

import math

import pytest
import torch

from attention.cpu_paths import cpu_path, use_torch_ops  # noqa: F401 - a fixture
from vllmpy.attention import cpu_backend
from vllmpy.attention.backend import FP8_KV_DTYPE, TorchReferenceBackend
from vllmpy.attention.cpu_backend import CpuAttentionBackend
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.layers.attention import Attention

BLOCK = 4
NUM_BLOCKS = 64


def make_step(requests, heads, kv_heads, dim, dtype, cache_dtype, padding=0, seed=0):
    """A random step: ``requests`` is a list of (seq_len, q_len); every request owns
    shuffled, non-contiguous blocks of a cache full of random values. Returns
    (q, k, v, cache, meta) with ``padding`` extra rows after the real tokens."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, kv_heads, dim, generator=gen)
    cache = (cache * 2).to(cache_dtype)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max(-(-seq_len // BLOCK) for seq_len, _ in requests)
    table = torch.zeros(len(requests), width + 1, dtype=torch.int32)  # one spare: padding
    starts, slots = [0], []
    for i, (seq_len, q_len) in enumerate(requests):
        own = [blocks.pop() for _ in range(-(-seq_len // BLOCK))]
        table[i, :len(own)] = torch.tensor(own, dtype=torch.int32)
        slots += [own[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len - q_len, seq_len)]
        starts.append(starts[-1] + q_len)
    rows = starts[-1] + padding
    slots += [blocks[0] * BLOCK] * padding  # a block nobody owns: it must stay as it was
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k = torch.randn(rows, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(rows, kv_heads, dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        num_actual_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32), query_start_loc_cpu=starts,
        seq_lens=torch.tensor([s for s, _ in requests], dtype=torch.int32),
        seq_lens_cpu=[s for s, _ in requests],
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=table,
        block_size=BLOCK, max_query_len=max(q for _, q in requests),
        max_seq_len=max(s for s, _ in requests))
    return q, k, v, cache, meta


def run_both(requests, heads=6, kv_heads=2, dim=16, dtype=torch.float32,
             cache_dtype=None, scales=(1.0, 1.0), padding=0):
    """(fast output, reference output, fast cache, reference cache) on the same step."""
    q, k, v, cache, meta = make_step(requests, heads, kv_heads, dim, dtype,
                                     cache_dtype or dtype, padding)
    scale = 1 / math.sqrt(dim)
    ref_cache, fast_cache = cache.clone(), cache.clone()
    expected = TorchReferenceBackend(heads, kv_heads, dim, scale).forward(
        q, k, v, ref_cache, meta, *scales)
    out = CpuAttentionBackend(heads, kv_heads, dim, scale).forward(
        q, k, v, fast_cache, meta, *scales)
    assert out.shape == q.shape and out.dtype == q.dtype
    n = meta.num_actual_tokens
    return out[:n], expected[:n], fast_cache, ref_cache


def same_cache(a, b):
    if a.dtype == FP8_KV_DTYPE:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


MIXES = {
    "one decode": [(37, 1)],
    "decodes of very different lengths": [(3, 1), (61, 1), (17, 1), (1, 1), (40, 1)],
    "decodes, a chunk over context, a fresh prefill": [(9, 1), (30, 1), (21, 8), (7, 7)],
    "prefill between decodes": [(5, 1), (12, 12), (33, 1), (26, 1), (19, 3), (8, 1)],
    "prefills only": [(13, 13), (31, 6)],
    "equal decode lengths": [(24, 1), (24, 1), (24, 1)],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2)])
def test_matches_the_reference_in_float32(cpu_path, mix, heads, kv_heads):
    out, expected, cache, ref_cache = run_both(MIXES[mix], heads, kv_heads)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    assert same_cache(cache, ref_cache)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_matches_the_reference_in_bfloat16(cpu_path, mix):
    out, expected, cache, ref_cache = run_both(MIXES[mix], 9, 3, 64, torch.bfloat16)
    # the fast path rounds once at the end; the reference rounds scores and weights too
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert same_cache(cache, ref_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.5)])
def test_fp8_cache_matches_the_reference(dtype, scales):
    mix = MIXES["decodes, a chunk over context, a fresh prefill"] + [(50, 1)]
    out, expected, cache, ref_cache = run_both(mix, 6, 2, 16, dtype, FP8_KV_DTYPE, scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert same_cache(cache, ref_cache)  # both quantize through write_kv_cache


def test_padded_rows_neither_write_the_cache_nor_disturb_real_rows(cpu_path):
    mix = MIXES["prefill between decodes"]
    out, expected, cache, ref_cache = run_both(mix, padding=3)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    assert same_cache(cache, ref_cache)  # the reference writes the real rows only


def test_a_long_prefill_split_into_pieces_matches_one_piece(monkeypatch):
    mix = [(45, 30), (20, 1)]
    whole, expected, _, _ = run_both(mix)
    monkeypatch.setattr(cpu_backend, "SCORES_BUDGET", 6 * 45 * 4)  # pieces of 4 queries
    pieces, _, _, _ = run_both(mix)
    torch.testing.assert_close(pieces, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pieces, expected, atol=2e-6, rtol=2e-5)


def test_a_request_with_no_new_tokens_is_skipped():
    out, expected, cache, ref_cache = run_both([(9, 1), (12, 0), (7, 3)])
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    assert same_cache(cache, ref_cache)


def test_a_decode_sees_exactly_its_own_tokens(cpu_path):
    """A decode of length L gives softmax-weighted values of its first L slots only: change
    what lies past L in its last block and the output stays the same."""
    q, k, v, cache, meta = make_step([(6, 1), (30, 1)], 4, 2, 8, torch.float32, torch.float32)
    backend = CpuAttentionBackend(4, 2, 8, 1 / math.sqrt(8))
    first = backend.forward(q, k, v, cache.clone(), meta)
    last_block = int(meta.block_tables[0, 1])
    cache[:, last_block, 2:] = 1e3  # positions 6, 7 of request 0: past its end
    second = backend.forward(q, k, v, cache, meta)
    torch.testing.assert_close(first, second, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_step_gives_each_row_what_its_own_decode_gives(dtype):
    """Speculative decoding's losslessness on the CPU: each query row of a short request
    (a verified draft) comes out bit for bit as the one-token decode at its position
    would, next to a decode and a long prefill in the same step."""
    from attention.cpu_paths import require_kernels
    require_kernels()
    requests = [(20, 5), (9, 1), (40, 24)]
    q, k, v, cache, meta = make_step(requests, 8, 2, 64, dtype, dtype)
    backend = CpuAttentionBackend(8, 2, 64, 0.125)
    verify = backend.forward(q, k, v, cache.clone(), meta)
    for j in range(5):  # row j of the verify: a decode of length 16 + j
        _, _, _, _, one = make_step([(16 + j, 1)], 8, 2, 64, dtype, dtype)
        one.block_tables, one.slot_mapping = meta.block_tables[:1], meta.slot_mapping[j:j + 1]
        # the cache as it is after the verify step wrote its five rows
        after = cache.clone()
        backend.forward(q, k, v, after, meta)
        decode = backend.forward(q[j:j + 1], k[j:j + 1], v[j:j + 1], after, one,
                                 kv_stored=True)
        assert torch.equal(decode[0], verify[j])


def test_bad_head_counts_are_refused_by_name():
    with pytest.raises(ValueError, match="num_heads \\(6\\).*num_kv_heads \\(4\\)"):
        CpuAttentionBackend(6, 4, 16, 0.25)


def test_the_attention_layer_serves_the_cpu_through_the_fast_backend():
    assert isinstance(Attention(4, 2, 16, 0.25).backend, CpuAttentionBackend)


def test_small_decode_steps_run_on_one_thread_and_give_the_threads_back(monkeypatch):
    use_torch_ops(monkeypatch)  # the PyTorch path's thread handling
    calls: list[int] = []
    monkeypatch.setattr(cpu_backend, "_OPENMP", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    decodes = MIXES["decodes of very different lengths"]  # 2 * 5 * 61 * 2 * 16 values
    out, expected, _, _ = run_both(decodes)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
    assert calls == [1, 4]
    calls.clear()
    monkeypatch.setattr(cpu_backend, "SERIAL_KV_ELEMENTS", 2 * 5 * 61 * 2 * 16 - 1)
    run_both(decodes)  # one value too many: both threads
    run_both(MIXES["decodes, a chunk over context, a fresh prefill"])  # not a decode step
    assert calls == []

    def fail(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(cpu_backend, "SERIAL_KV_ELEMENTS", 1 << 18)
    monkeypatch.setattr(CpuAttentionBackend, "_decode", fail)
    with pytest.raises(RuntimeError, match="boom"):
        run_both(decodes)
    assert calls == [1, 4]


@pytest.mark.parametrize("backend", [CpuAttentionBackend, TorchReferenceBackend])
@pytest.mark.parametrize("mix", ["one decode", "decodes, a chunk over context, a fresh prefill"])
def test_kv_stored_skips_the_write_and_reads_what_the_caller_stored(cpu_path, backend, mix):
    from vllmpy.attention.backend import write_kv_cache

    q, k, v, cache, meta = make_step(MIXES[mix], 6, 2, 16, torch.float32, torch.float32)
    n = meta.num_actual_tokens
    stored = cache.clone()
    write_kv_cache(k[:n], v[:n], stored, meta.slot_mapping[:n])  # as a fused kernel would
    impl = backend(6, 2, 16, 0.25)
    expected = impl.forward(q, k, v, cache.clone(), meta)
    # the keys and values passed in are ignored: garbage in them must not reach the cache
    before = stored.clone()
    out = impl.forward(q, k.neg(), v.neg(), stored, meta, kv_stored=True)
    assert torch.equal(stored, before)
    torch.testing.assert_close(out[:n], expected[:n], atol=0, rtol=0)
