"""The MLA Triton kernels against their PyTorch references, and the CUDA backend against
the PyTorch one.

Without CUDA the kernels run under Triton's interpreter on small fp32 shapes; with CUDA
they also run in bfloat16 and on DeepSeek's own latent width (512 + 64).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vllmpy.attention.metadata import AttentionMetadata  # noqa: E402
from vllmpy.attention.mla_backend import (  # noqa: E402
    MLADims,
    TorchMLABackend,
    UpProjection,
)
from vllmpy.attention.mla_triton_backend import TritonMLABackend  # noqa: E402
from vllmpy.ops.mla_attention import (  # noqa: E402
    absorbed_attention,
    absorbed_attention_ref,
    write_latents,
    write_latents_ref,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
FP8 = torch.float8_e4m3fn

# (query length, sequence length): a long decode, a chunk after cached context, a fresh
# prefill, a short decode
MIXED = [(1, 45), (6, 17), (9, 9), (1, 2)]


def make_batch(reqs, heads, lat, rope, block_size, dtype, seed=0):
    """Random latent cache, absorbed queries and metadata tensors; each request's blocks
    are scattered over the pool in a random order."""
    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-seq_len // block_size) for _, seq_len in reqs]
    num_blocks = sum(per_req) + 3
    cache = torch.randn(num_blocks, block_size, lat + rope, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(reqs), max(per_req) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_req):
        tables[i, :n] = perm[used:used + n]
        used += n
    starts = [0]
    for q_len, _ in reqs:
        starts.append(starts[-1] + q_len)
    return dict(
        q_lat=torch.randn(starts[-1], heads, lat, generator=gen).to(DEVICE, dtype),
        q_pe=torch.randn(starts[-1], heads, rope, generator=gen).to(DEVICE, dtype),
        cache=cache.to(DEVICE, dtype),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE))


def run(batch, reqs, scale=0.3, **kwargs):
    out = torch.full_like(batch["q_lat"], 7.0)
    absorbed_attention(out=out, scale=scale, max_query_len=max(q for q, _ in reqs),
                       max_seq_len=max(s for _, s in reqs), **batch, **kwargs)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("heads,lat,rope", [(4, 32, 16), (20, 24, 8)]
                         + ([(16, 512, 64), (128, 512, 64)] if CUDA else []))
def test_absorbed_attention_matches_reference_on_a_mixed_batch(dtype, num_splits, heads,
                                                               lat, rope):
    """Decodes, a chunk after context and a prefill in one launch (heads over two head
    blocks and widths that are no power of two in the second shape), with and without
    split-KV."""
    batch = make_batch(MIXED, heads, lat, rope, 4 if lat < 512 else 16, dtype)
    ref = absorbed_attention_ref(scale=0.3 if lat < 512 else lat ** -0.5, **batch)
    out = run(batch, MIXED, num_splits=num_splits, scale=0.3 if lat < 512 else lat ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_absorbed_attention_leaves_longer_requests_alone():
    """``max_query_len_absorbed=1``: the decodes are computed, the rows of the longer
    requests keep what they held."""
    batch = make_batch(MIXED, 4, 32, 16, 4, torch.float32, seed=1)
    ref = absorbed_attention_ref(scale=0.3, **batch)
    out = run(batch, MIXED, max_query_len_absorbed=1, num_splits=2)
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[-1], ref[-1], atol=1e-5, rtol=1e-5)
    assert bool((out[1:-1] == 7.0).all())


def test_absorbed_attention_over_an_fp8_cache_reads_page_times_scale():
    batch = make_batch(MIXED, 4, 32, 16, 4, torch.float32, seed=2)
    scale = 0.25
    batch["cache"] = (batch["cache"] * 3 / scale).clamp(-448, 448).to(FP8)
    ref = absorbed_attention_ref(scale=0.3, kv_scale=scale, **batch)
    plain = absorbed_attention_ref(scale=0.3, **{**batch,
                                                 "cache": batch["cache"].float() * scale})
    torch.testing.assert_close(ref, plain, atol=0, rtol=0)
    out = run(batch, MIXED, kv_scale=scale, num_splits=2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_write_latents_matches_reference(dtype):
    """Rows land at their slots (negative ones skipped); an fp8 cache holds them divided
    by the scale and saturated. The fp8 values are ones e4m3 holds exactly after the
    division (the interpreter's fp8 conversion does not round as torch does)."""
    gen = torch.Generator().manual_seed(3)
    lat, rope, scale = 24, 8, 0.5
    rows = torch.randn(6, lat + rope, generator=gen)
    if dtype == FP8:
        rows = rows.mul(8).to(FP8).float() * scale
        rows[0, :3] = torch.tensor([1000.0, -1000.0, 224.0])  # saturate, and exactly 448
    rows = rows.to(DEVICE)
    c_kv, k_pe = rows[:, :lat].contiguous(), rows[:, lat:].contiguous()
    slots = torch.tensor([9, 0, -1, 31, 4, 17], device=DEVICE)
    ours = torch.zeros(4, 8, lat + rope, dtype=dtype, device=DEVICE)
    ref = ours.clone()
    write_latents(c_kv, k_pe, ours, slots, scale)
    write_latents_ref(c_kv, k_pe, ref, slots, scale)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    flat = ref.float().view(32, -1) * (scale if dtype == FP8 else 1.0)
    expected = rows.float().clone()
    if dtype == FP8:
        expected[0, :3] = torch.tensor([224.0, -224.0, 224.0])
    torch.testing.assert_close(flat[slots[slots >= 0].long()], expected[slots >= 0])
    assert bool((flat[2] == 0).all())


def test_launchers_refuse_mismatched_shapes():
    batch = make_batch(MIXED, 4, 32, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="add up to the cache rows"):
        absorbed_attention(out=batch["q_lat"].clone(), scale=1.0, max_query_len=9,
                           max_seq_len=45, **{**batch, "q_pe": batch["q_pe"][..., :8]})
    with pytest.raises(ValueError, match="int32"):
        run({**batch, "seq_lens": batch["seq_lens"].long()}, MIXED)
    with pytest.raises(ValueError, match="widths must add up"):
        write_latents(torch.zeros(2, 32, device=DEVICE), torch.zeros(2, 8, device=DEVICE),
                      batch["cache"], torch.zeros(2, dtype=torch.long, device=DEVICE))


# ---- the backends ---------------------------------------------------------------------

class _UpProj(torch.nn.Module):
    def __init__(self, dims: MLADims, gen: torch.Generator) -> None:
        super().__init__()
        out = dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
        self.weight = torch.randn(out, dims.kv_lora_rank, generator=gen) * 0.3

    def forward(self, x):
        return x @ self.weight.to(x).t()


def _step_meta(reqs, tables, block_size):
    starts, slots = [0], []
    for i, (q_len, seq_len) in enumerate(reqs):
        starts.append(starts[-1] + q_len)
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    lens = [s for _, s in reqs]
    return AttentionMetadata(
        num_actual_tokens=starts[-1],
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        query_start_loc_cpu=starts, seq_lens=torch.tensor(lens, dtype=torch.int32,
                                                          device=DEVICE),
        seq_lens_cpu=lens, slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=tables.to(DEVICE), block_size=block_size)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
@pytest.mark.parametrize("steps", [
    [[(9, 9), (5, 5)], [(1, 10), (4, 9)], [(1, 11), (1, 10)]],  # prefill, mixed, decode
    [[(3, 3)], [(1, 4)]],
])
def test_triton_backend_matches_torch_backend(cache_dtype, steps):
    """Step after step over one cache: the Triton backend (absorbed kernel, with the
    expanded path for longer requests in a mixed step) and the PyTorch one agree, and so
    do the caches they write."""
    gen = torch.Generator().manual_seed(4)
    dims, bs = MLADims(4, 16, 8, 12, 24), 4
    up = UpProjection.of(_UpProj(dims, gen), dims, torch.float32, DEVICE)
    tables = torch.randperm(12, generator=gen)[:8].view(2, 4).to(torch.int32)
    ours, ref = TritonMLABackend(dims, 0.3), TorchMLABackend(dims, 0.3)
    cache_a = torch.zeros(12, bs, dims.latent_dim, dtype=cache_dtype, device=DEVICE)
    cache_b = cache_a.clone()
    for reqs in steps:
        meta = _step_meta(reqs, tables[:len(reqs)], bs)
        t = meta.num_actual_tokens
        q_nope, q_pe = torch.randn(t, 4, 16, generator=gen), torch.randn(t, 4, 8, generator=gen)
        c_kv, k_pe = torch.randn(t, 24, generator=gen), torch.randn(t, 8, generator=gen)
        if cache_dtype == FP8:  # rows e4m3 holds exactly: both write the same bytes
            c_kv, k_pe = (x.mul(8).to(FP8).float() / 8 for x in (c_kv, k_pe))
        q_nope, q_pe, c_kv, k_pe = (x.to(DEVICE) for x in (q_nope, q_pe, c_kv, k_pe))
        a = ours.forward(q_nope, q_pe, c_kv, k_pe, cache_a, meta, up, kv_scale=0.125)
        b = ref.forward(q_nope, q_pe, c_kv, k_pe, cache_b, meta, up, kv_scale=0.125)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache_a.view(torch.uint8), cache_b.view(torch.uint8))


def test_absorbed_and_expanded_paths_agree():
    """One decode through the PyTorch backend's absorbed path equals the same query as
    the last row of a 2-token chunk, which takes the expanded path."""
    gen = torch.Generator().manual_seed(5)
    dims, bs = MLADims(4, 16, 8, 12, 24), 4
    up = UpProjection.of(_UpProj(dims, gen), dims, torch.float32, DEVICE)
    tables = torch.tensor([[3, 0, 2]], dtype=torch.int32)
    backend = TorchMLABackend(dims, 0.3)
    cache = torch.zeros(4, bs, dims.latent_dim, device=DEVICE)
    q_nope, q_pe = torch.randn(10, 4, 16, generator=gen), torch.randn(10, 4, 8, generator=gen)
    c_kv, k_pe = torch.randn(10, 24, generator=gen), torch.randn(10, 8, generator=gen)
    q_nope, q_pe, c_kv, k_pe = (x.to(DEVICE) for x in (q_nope, q_pe, c_kv, k_pe))

    def step(rows: slice, reqs, into: torch.Tensor) -> torch.Tensor:
        return backend.forward(q_nope[rows], q_pe[rows], c_kv[rows], k_pe[rows], into,
                               _step_meta(reqs, tables, bs), up)

    step(slice(0, 8), [(8, 8)], cache)
    chunk = step(slice(8, 10), [(2, 10)], cache.clone())
    step(slice(8, 9), [(1, 9)], cache)
    decode = step(slice(9, 10), [(1, 10)], cache)
    torch.testing.assert_close(decode[0], chunk[1], atol=1e-5, rtol=1e-5)
