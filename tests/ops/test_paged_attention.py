"""The paged-attention Triton kernels against their PyTorch references.

Without CUDA the kernels run under Triton's interpreter on small fp32 shapes; with CUDA
they also run in bf16 and fp16 and on a model-sized shape.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from vllmpy.attention.backend import TorchReferenceBackend, write_kv_cache  # noqa: E402
from vllmpy.attention.metadata import AttentionMetadata  # noqa: E402
from vllmpy.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from vllmpy.ops.paged_attention import (  # noqa: E402
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    paged_attention,
    paged_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}

# (query length, sequence length): a long decode, a chunk after cached context, a fresh
# prefill, a short decode
MIXED = [(1, 150), (9, 40), (13, 13), (1, 3)]


def make_batch(reqs, heads, kv_heads, dim, block_size, dtype, seed=0, pad_rows=0):
    """Random cache, queries and metadata tensors; each request's blocks are scattered
    over the pool in a random order."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq_len // block_size) for _, seq_len in reqs]
    num_blocks = sum(blocks_per_req) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(reqs), max(blocks_per_req) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        tables[i, :n] = perm[used:used + n]
        used += n
    starts = [0]
    for q_len, _ in reqs:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1] + pad_rows, heads, dim, generator=gen)
    return dict(
        q=q.to(DEVICE, dtype), kv_cache=cache.to(DEVICE, dtype),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE))


def run_both(batch, reqs, num_splits=None, max_query_len=None):
    scale = 1 / math.sqrt(batch["q"].shape[-1])
    ref = paged_attention_ref(scale=scale, **batch)
    out = torch.full_like(batch["q"], 7.0)
    paged_attention(out=out, scale=scale, num_splits=num_splits,
                    max_query_len=max_query_len or max(r[0] for r in reqs),
                    max_seq_len=max(r[1] for r in reqs), **batch)
    return out, ref


def assert_close(out, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# ---- reshape_and_cache -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,dim,block_size", [(2, 64, 16), (3, 128, 32)])
def test_reshape_and_cache_matches_reference_and_skips_negative_slots(
        dtype, kv_heads, dim, block_size):
    gen = torch.Generator().manual_seed(1)
    num_blocks, n = 6, 11
    k = torch.randn(n, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(n, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[2, 7]] = -1  # padding rows
    slots = slots.to(DEVICE)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    expected = cache.clone()
    reshape_and_cache(k, v, cache, slots)
    reshape_and_cache_ref(k, v, expected, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
    keep = slots >= 0
    backend_written = cache.clone()
    write_kv_cache(k[keep], v[keep], backend_written, slots[keep])
    torch.testing.assert_close(cache, backend_written, atol=0, rtol=0)


def test_reshape_and_cache_casts_to_the_cache_dtype_and_takes_int32_slots():
    k = torch.randn(3, 2, 16, device=DEVICE)
    v = torch.randn(3, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=torch.float16, device=DEVICE)
    slots = torch.tensor([5, -1, 0], dtype=torch.int32, device=DEVICE)
    reshape_and_cache(k, v, cache, slots)
    torch.testing.assert_close(cache[0, 1, 1], k[0].half())
    torch.testing.assert_close(cache[1, 0, 0], v[2].half())
    assert cache.flatten(1, 2)[:, [1, 2, 3, 4, 6, 7]].abs().sum() == 0


# ---- paged_attention ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [
    (2, 2, 64, 16),  # MHA
    (4, 2, 128, 32),  # GQA 2
    (8, 2, 64, 32),  # GQA 4
    (6, 2, 64, 16),  # GQA 3: a group that is no power of two
])
def test_mixed_batch_matches_reference(dtype, heads, kv_heads, dim, block_size):
    batch = make_batch(MIXED, heads, kv_heads, dim, block_size, dtype)
    out, ref = run_both(batch, MIXED, num_splits=1)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_over_a_mixed_batch_matches_reference(dtype):
    # 3 splits of a 150-token decode, and splits left empty for the short requests
    batch = make_batch(MIXED, 4, 2, 64, 16, dtype, seed=2)
    out, ref = run_both(batch, MIXED, num_splits=3)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_decode_batch_takes_split_kv_and_matches_reference(dtype):
    reqs = [(1, 2 * MIN_TOKENS_PER_SPLIT + 37), (1, 20)]
    batch = make_batch(reqs, 4, 1, 64, 32, dtype, seed=3)
    # two requests x one KV head on a device of 4+ multiprocessors: splits are chosen
    assert choose_num_splits(2, reqs[0][1], 4) == 2
    out, ref = run_both(batch, reqs)  # split count chosen by the launcher
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("max_query_len", [1, 64])
def test_kernel_variant_never_changes_the_result(max_query_len):
    # the decode-shaped and the prefill-shaped variant both handle any batch
    batch = make_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=4)
    out, ref = run_both(batch, MIXED, max_query_len=max_query_len, num_splits=1)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_padding_rows_past_the_last_request_are_left_alone(num_splits):
    reqs = [(1, 40), (2, 9)]
    batch = make_batch(reqs, 2, 1, 64, 16, torch.float32, seed=5, pad_rows=5)
    out, ref = run_both(batch, reqs, num_splits=num_splits)
    assert_close(out[:3], ref[:3], torch.float32)
    assert (out[3:] == 7.0).all()


def test_choose_num_splits_fills_the_device_only_for_long_contexts():
    # one request, 8 KV heads on 132 multiprocessors: as many splits as 256-key runs allow
    assert choose_num_splits(8, 4096, 132) == 16
    assert choose_num_splits(8, 32768, 132) == 32  # 33 wanted, rounded to a power of two
    assert choose_num_splits(8, 300, 132) == 1  # too short to split
    assert choose_num_splits(64 * 8, 1024, 132) == 1  # the batch already fills the GPU
    assert choose_num_splits(16 * 8, 8192, 132) == 2


@pytest.mark.skipif(not CUDA, reason="model-sized shape; needs CUDA")
@pytest.mark.parametrize("reqs", [
    [(1, 4096)],  # one long decode: split-KV
    [(1, 1000)] * 30 + [(512, 2048), (300, 300)],  # decodes, a chunk on context, a prefill
])
def test_model_sized_batches_on_cuda(reqs):
    batch = make_batch(reqs, 32, 8, 128, 32, torch.bfloat16, seed=6)
    out, ref = run_both(batch, reqs)
    assert_close(out, ref, torch.bfloat16)


def test_launcher_refuses_mismatched_arguments_by_name():
    batch = make_batch([(1, 5)], 4, 2, 64, 16, torch.float32)
    out = torch.empty_like(batch["q"])
    common = dict(scale=0.1, max_query_len=1, max_seq_len=5)
    with pytest.raises(ValueError, match="q must be"):
        paged_attention(**{**batch, "q": batch["q"][..., :32]}, out=out[..., :32], **common)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(**{**batch, "q": batch["q"][:, :3]}, out=out[:, :3], **common)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        paged_attention(**{**batch, "seq_lens": batch["seq_lens"].long()}, out=out, **common)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention(**{**batch, "block_tables": batch["block_tables"][0]}, out=out, **common)
    with pytest.raises(ValueError, match="out must have"):
        paged_attention(**batch, out=out[:, :2], **common)
    with pytest.raises(ValueError, match="float64"):
        paged_attention(**{**batch, "q": batch["q"].double()}, out=out.double(), **common)
    with pytest.raises(ValueError, match="kv_cache must be"):
        paged_attention(**{**batch, "kv_cache": batch["kv_cache"][0]}, out=out, **common)
    k = torch.zeros(2, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        reshape_and_cache(k, k, batch["kv_cache"], torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="v must be"):
        reshape_and_cache(k, k[:, :1], batch["kv_cache"], torch.zeros(2, dtype=torch.long,
                                                                       device=DEVICE))


# ---- the backend ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backend_matches_torch_reference_backend(dtype):
    heads, kv_heads, dim, bs = 4, 2, 64, 16
    reqs = [(1, 70), (6, 22), (5, 5)]
    batch = make_batch(reqs, heads, kv_heads, dim, bs, dtype, seed=7)
    starts = batch["query_start_loc"].tolist()
    num_tokens = starts[-1]
    # the new tokens' slots follow each request's block table
    slots = []
    for i, (q_len, seq_len) in enumerate(reqs):
        table = batch["block_tables"][i].tolist()
        slots += [table[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens, query_start_loc=batch["query_start_loc"],
        query_start_loc_cpu=starts, seq_lens=batch["seq_lens"],
        seq_lens_cpu=[s for _, s in reqs],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=batch["block_tables"], block_size=bs)
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(num_tokens, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_tokens, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    scale = 1 / math.sqrt(dim)
    ref_cache = batch["kv_cache"].clone()
    expected = TorchReferenceBackend(heads, kv_heads, dim, scale).forward(
        batch["q"], k, v, ref_cache, meta)
    cache = batch["kv_cache"].clone()
    out = TritonAttentionBackend(heads, kv_heads, dim, scale).forward(
        batch["q"], k, v, cache, meta)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    assert_close(out, expected, dtype)


# ---- fp8 KV cache --------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
FP8_OK_ON_DEVICE = not CUDA or torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_device = pytest.mark.skipif(not FP8_OK_ON_DEVICE,
                                      reason="fp8 e4m3 in Triton needs compute capability 8.9+")
K_SCALE, V_SCALE = 0.05, 0.3


def quantize(x, scale):
    """x / scale rounded to e4m3 by torch, saturating at 448: what an fp8 page holds."""
    return (x.float() / scale).clamp(-448, 448).to(FP8)


def fp8_batch(reqs, heads, kv_heads, dim, block_size, dtype, seed=0):
    """make_batch with its cache stored as fp8 pages: keys / K_SCALE, values / V_SCALE."""
    batch = make_batch(reqs, heads, kv_heads, dim, block_size, torch.float32, seed=seed)
    cache = batch["kv_cache"] * 4  # some values past 448 * scale: the clamp is exercised
    batch["kv_cache"] = torch.stack([quantize(cache[0], K_SCALE), quantize(cache[1], V_SCALE)])
    batch["q"] = batch["q"].to(dtype)
    return batch


@pytest.fixture(scope="module")
def kernel_writes_fp8_exactly():
    """Skips a test when the Triton kernels cannot convert fp32 to e4m3 as torch does. This
    happens for one reason only: Triton's interpreter (the CPU path) drops the carry of a
    rounded-up mantissa into the exponent (31.9 becomes 16, not 32)."""
    probe = torch.tensor([31.9, -124.6, 1.97, 0.3, 447.0, -600.0, 17.0, 0.0] * 2,
                         device=DEVICE).view(1, 1, 16)
    cache = torch.zeros(2, 1, 1, 1, 16, dtype=FP8, device=DEVICE)
    reshape_and_cache(probe, probe, cache, torch.zeros(1, dtype=torch.long, device=DEVICE))
    if not torch.equal(cache[0, 0, 0, 0].view(torch.uint8),
                       quantize(probe[0, 0], 1.0).view(torch.uint8)):
        pytest.skip("Triton's interpreter converts fp32 to fp8 e4m3 without carrying a "
                    "rounded-up mantissa into the exponent, so kernel-written fp8 pages "
                    "cannot be checked on the CPU")


def test_fp8_reference_reads_page_times_scale():
    # the references' fp8 path against the plain path over the dequantized values
    batch = fp8_batch(MIXED, 4, 2, 64, 16, torch.float32, seed=9)
    scale = 1 / 8
    ref = paged_attention_ref(scale=scale, k_scale=K_SCALE, v_scale=V_SCALE, **batch)
    cache = batch["kv_cache"].float()
    plain = {**batch, "kv_cache": torch.stack([cache[0] * K_SCALE, cache[1] * V_SCALE])}
    torch.testing.assert_close(ref, paged_attention_ref(scale=scale, **plain), atol=0, rtol=0)


def test_fp8_reference_write_quantizes_with_the_scale_and_saturates():
    gen = torch.Generator().manual_seed(10)
    k = torch.randn(6, 2, 16, generator=gen) * 20
    v = torch.randn(6, 2, 16, generator=gen)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 224.0, 0.0])  # 224 / 0.5 = 448: the largest
    slots = torch.tensor([9, 0, -1, 31, 4, 17])
    cache = torch.zeros(2, 4, 8, 2, 16, dtype=FP8)
    reshape_and_cache_ref(k, v, cache, slots, k_scale=0.5, v_scale=0.01)
    flat = cache.float().view(2, 32, 2, 16)
    keys, values = flat[0] * 0.5, flat[1] * 0.01
    assert keys[9, 0, :4].tolist() == [224.0, -224.0, 224.0, 0.0]
    keep = slots >= 0
    for got, x, s in ((keys[slots[keep]], k[keep].clamp(-224, 224), 0.5),
                      (values[slots[keep]], v[keep], 0.01)):
        # e4m3 keeps 3 mantissa bits: round to nearest is within 2**-4 relative, or half
        # the smallest subnormal step (2**-9) times the scale near zero
        assert ((got - x).abs() <= x.abs() * 2 ** -4 + 2 ** -10 * s).all()
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(32) if s not in written]
    assert flat[:, untouched].abs().sum() == 0
    # the CPU backend stores the same bytes
    by_backend = torch.zeros_like(cache)
    write_kv_cache(k[keep], v[keep], by_backend, slots[keep], 0.5, 0.01)
    assert torch.equal(by_backend.view(torch.uint8), cache.view(torch.uint8))


@needs_fp8_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,num_splits", [
    (4, 2, 64, 16, 1),
    (6, 2, 64, 16, 1),  # a head group that is no power of two
    (4, 2, 128, 32, 3),  # split-KV
])
def test_fp8_paged_attention_reads_fp8_pages_like_the_reference(
        dtype, heads, kv_heads, dim, block_size, num_splits):
    batch = fp8_batch(MIXED, heads, kv_heads, dim, block_size, dtype, seed=11)
    scale = 1 / math.sqrt(dim)
    ref = paged_attention_ref(scale=scale, k_scale=K_SCALE, v_scale=V_SCALE, **batch)
    out = torch.full_like(batch["q"], 7.0)
    paged_attention(out=out, scale=scale, num_splits=num_splits, max_query_len=13,
                    max_seq_len=150, k_scale=K_SCALE, v_scale=V_SCALE, **batch)
    # values reach 448 * V_SCALE: in bf16 / fp16 the rounding of the weighted sum is
    # relative to that scale, not to each (possibly cancelled) output element
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol,
                               atol=tol * ref.abs().max().item())


@needs_fp8_device
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_reshape_and_cache_matches_reference(dtype, kernel_writes_fp8_exactly):
    gen = torch.Generator().manual_seed(12)
    k = (torch.randn(11, 2, 64, generator=gen) * 30).to(DEVICE, dtype)
    v = torch.randn(11, 2, 64, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(6 * 16, generator=gen)[:11]
    slots[[2, 7]] = -1
    slots = slots.to(DEVICE)
    cache = torch.zeros(2, 6, 16, 2, 64, dtype=FP8, device=DEVICE)
    expected = cache.clone()
    reshape_and_cache(k, v, cache, slots, k_scale=0.05, v_scale=0.01)
    reshape_and_cache_ref(k, v, expected, slots, k_scale=0.05, v_scale=0.01)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@needs_fp8_device
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_triton_backend_matches_torch_reference_backend(dtype, kernel_writes_fp8_exactly):
    heads, kv_heads, dim, bs = 4, 2, 64, 16
    reqs = [(1, 70), (6, 22), (5, 5)]
    batch = fp8_batch(reqs, heads, kv_heads, dim, bs, dtype, seed=13)
    starts = batch["query_start_loc"].tolist()
    slots = []
    for i, (q_len, seq_len) in enumerate(reqs):
        table = batch["block_tables"][i].tolist()
        slots += [table[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
    meta = AttentionMetadata(
        num_actual_tokens=starts[-1], query_start_loc=batch["query_start_loc"],
        query_start_loc_cpu=starts, seq_lens=batch["seq_lens"],
        seq_lens_cpu=[s for _, s in reqs],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=batch["block_tables"], block_size=bs)
    gen = torch.Generator().manual_seed(14)
    k = (torch.randn(starts[-1], kv_heads, dim, generator=gen) * 4).to(DEVICE, dtype)
    v = (torch.randn(starts[-1], kv_heads, dim, generator=gen) * 4).to(DEVICE, dtype)
    scale = 1 / math.sqrt(dim)
    ref_cache = batch["kv_cache"].clone()
    expected = TorchReferenceBackend(heads, kv_heads, dim, scale).forward(
        batch["q"], k, v, ref_cache, meta, K_SCALE, V_SCALE)
    cache = batch["kv_cache"].clone()
    out = TritonAttentionBackend(heads, kv_heads, dim, scale).forward(
        batch["q"], k, v, cache, meta, K_SCALE, V_SCALE)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    # fp8 values reach 448 * scale: bf16 / fp16 rounding is relative to that magnitude
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol,
                               atol=tol * expected.abs().max().item())


def test_fp8_launchers_refuse_bad_scales_and_caches_by_name():
    batch = fp8_batch([(1, 5)], 4, 2, 64, 16, torch.float32)
    out = torch.empty_like(batch["q"])
    common = dict(scale=0.1, max_query_len=1, max_seq_len=5)
    with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
        paged_attention(**batch, out=out, k_scale=0.0, **common)
    k = torch.zeros(2, 2, 64, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="v_scale must be a positive finite number"):
        reshape_and_cache(k, k, batch["kv_cache"], slots, v_scale=float("nan"))
    with pytest.raises(ValueError, match="kv_cache has dtype torch.int8"):
        reshape_and_cache(k, k, batch["kv_cache"].view(torch.int8), slots)
