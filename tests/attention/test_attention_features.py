"""Sliding windows, logit softcaps and attention sinks in the CPU backends, against dense
attention written out here: every key at its position, the visibility mask, the cap and the
softmax (with each head's sink as one more column, dropped after it).

Requests go through steps as an engine would drive them (prefills, chunks over cached
context, mixed batches, many decodes), and every step of every layer is checked. The CPU
backend runs both ways a decode can take: a fresh gather each step, and the decode copies
kept across steps (``_DecodeMirror``), small enough here that their rows go round."""

from __future__ import annotations

import math

import pytest
import torch

from vllmpy.attention import cpu_backend
from vllmpy.attention.backend import FP8_KV_DTYPE, AttentionBackend, TorchReferenceBackend
from attention.cpu_paths import require_kernels, use_torch_ops
from vllmpy.attention.cpu_backend import CpuAttentionBackend, _DecodePlan
from vllmpy.attention.metadata import AttentionMetadata

BLOCK = 4
MISSING = 1 << 30  # a block id past every cache
DIM = 16
SCALE = 1 / math.sqrt(DIM)


def dense_attention(q, keys, values, q_pos, window, cap, sinks=None):
    """Queries q [T, H, D] at positions ``q_pos`` [T] over the keys and values [L, KH, D]
    at positions 0..L-1, in float64: a query at p sees the keys at k <= p with
    p - k < window; scores scale * q.k, capped as cap * tanh(s / cap); ``sinks`` [H]
    one more softmax column per head, which weighs no value."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,khd->htk", q.double(), k) * SCALE
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    k_pos = torch.arange(keys.shape[0])
    seen = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen &= q_pos[:, None] - k_pos[None, :] < window
    scores = scores.masked_fill(~seen[None], float("-inf"))  # [H, T, L]
    if sinks is None:
        return torch.einsum("htk,khd->thd", scores.softmax(dim=-1), v)
    column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
    weights = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("htk,khd->thd", weights, v)


def fp8_round_trip(x, scale):
    """What an fp8 cache gives back for x: e4m3(clamp(x / scale, +-448)) * scale."""
    return (x / scale).clamp(-448, 448).to(FP8_KV_DTYPE).float() * scale


@pytest.fixture(autouse=True)
def one_thread():
    """These ops are tiny: on one thread, rather than two waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["C kernels", "gather", "copies"])
def path(request, monkeypatch):
    """How the CPU backend runs decode steps: the C kernels reading the blocks in place,
    or PyTorch's ops on them gathered afresh, or on copies kept across steps whose rows
    hold 8 tokens more at a time (short rings)."""
    if request.param == "C kernels":
        require_kernels()
        return request.param
    use_torch_ops(monkeypatch)
    if request.param == "copies":
        monkeypatch.setattr(cpu_backend, "MIRROR_MIN_KV_ELEMENTS", 0)
        monkeypatch.setattr(cpu_backend, "MIRROR_STEP", 8)
    else:
        monkeypatch.setattr(cpu_backend, "MIRROR_MIN_KV_ELEMENTS", 1 << 60)
    return request.param


def both_backends(window=None, cap=None, heads=6, kv_heads=2) -> list[AttentionBackend]:
    return [cls(heads, kv_heads, DIM, SCALE, sliding_window=window, logit_softcap=cap)
            for cls in (TorchReferenceBackend, CpuAttentionBackend)]


class Requests:
    """Requests over one paged cache per layer (backend); block 0 is never handed out: it
    is what the block tables are padded with. Each step gives every layer random queries,
    keys and values and checks its output against ``dense_attention`` over everything the
    request has stored so far."""

    def __init__(self, layers: list[AttentionBackend], cache_dtype=torch.float32,
                 scales=(1.0, 1.0), key_gain=1.0, num_blocks=80, seed=0,
                 sink_gain: float | None = None) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        # per layer: sinks [heads] around +2 (a real share of every softmax), or None
        self.sinks = [None if sink_gain is None else
                      torch.randn(layer.num_heads, generator=self.gen) * sink_gain + 2.0
                      for layer in layers]
        self.layers, self.scales, self.key_gain = layers, scales, key_gain
        self.caches = [(torch.randn(2, num_blocks, BLOCK, layer.num_kv_heads, DIM,
                                    generator=self.gen) * 2).to(cache_dtype)
                       for layer in layers]
        self.free = [int(b) + 1 for b in torch.randperm(num_blocks - 1, generator=self.gen)]
        self.blocks: dict[str, list[int]] = {}
        self.dropped: dict[str, int] = {}  # leading blocks shown as MISSING in the tables
        self.stored: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # per layer
        self.features_mattered = False  # some output differed from plain causal attention

    def finish(self, name: str) -> None:
        self.free[:0] = self.blocks.pop(name)
        del self.stored[name]

    def length(self, name: str) -> int:
        return self.stored[name][0][0].shape[0] if name in self.stored else 0

    def step(self, rows: list[tuple[str, int]]) -> AttentionMetadata:
        """``rows``: (request, new tokens) in row order; a new name starts a request."""
        starts, slots, seq_lens = [0], [], []
        for name, new in rows:
            length = self.length(name) + new
            own = self.blocks.setdefault(name, [])
            while len(own) * BLOCK < length:
                own.append(self.free.pop(0))
            slots += [own[p // BLOCK] * BLOCK + p % BLOCK for p in range(length - new, length)]
            starts.append(starts[-1] + new)
            seq_lens.append(length)
        table = torch.zeros(len(rows), max(len(self.blocks[n]) for n, _ in rows) + 1,
                            dtype=torch.int32)
        for i, (name, _) in enumerate(rows):
            table[i, :len(self.blocks[name])] = torch.tensor(self.blocks[name])
            table[i, :self.dropped.get(name, 0)] = MISSING
        meta = AttentionMetadata(
            num_actual_tokens=starts[-1],
            query_start_loc=torch.tensor(starts, dtype=torch.int32), query_start_loc_cpu=starts,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), seq_lens_cpu=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=table,
            block_size=BLOCK, max_query_len=max(n for _, n in rows), max_seq_len=max(seq_lens))
        for name, _ in rows:
            self.stored.setdefault(name, [(torch.empty(0, layer.num_kv_heads, DIM),) * 2
                                          for layer in self.layers])
        for index, (layer, cache) in enumerate(zip(self.layers, self.caches)):
            self._check(index, layer, cache, meta, rows)
        return meta

    def _check(self, index, layer, cache, meta, rows) -> None:
        n, gen = meta.num_actual_tokens, self.gen
        q = torch.randn(n, layer.num_heads, DIM, generator=gen)
        k = torch.randn(n, layer.num_kv_heads, DIM, generator=gen) * self.key_gain
        v = torch.randn(n, layer.num_kv_heads, DIM, generator=gen)
        sinks = self.sinks[index]
        out = layer.forward(q, k, v, cache, meta, *self.scales, sinks=sinks)
        if cache.dtype == FP8_KV_DTYPE:
            k, v = fp8_round_trip(k, self.scales[0]), fp8_round_trip(v, self.scales[1])
        starts = meta.query_start_loc_cpu
        for i, (name, _) in enumerate(rows):
            lo, hi = starts[i], starts[i + 1]
            keys, values = self.stored[name][index]
            keys, values = torch.cat([keys, k[lo:hi]]), torch.cat([values, v[lo:hi]])
            self.stored[name][index] = keys, values
            q_pos = torch.arange(keys.shape[0] - (hi - lo), keys.shape[0])
            expected = dense_attention(q[lo:hi], keys, values, q_pos, layer.sliding_window,
                                       layer.logit_softcap, sinks)
            torch.testing.assert_close(
                out[lo:hi].double(), expected, atol=2e-5, rtol=2e-5,
                msg=lambda m, i=i: f"{type(layer).__name__} layer {index}, row {i} of {rows}: {m}")
            if not self.features_mattered:
                plain = dense_attention(q[lo:hi], keys, values, q_pos, None, None)
                self.features_mattered = not torch.allclose(plain, expected, atol=1e-3)

    def decode(self, names: list[str], steps: int = 1) -> None:
        for _ in range(steps):
            self.step([(name, 1) for name in names])

    def drop_blocks_before_windows(self) -> None:
        """From now on the block tables name ``MISSING`` for every block whose keys lie
        before the window of each request's next query (at its current length), as an
        engine that frees them would: a backend that looks one up fails."""
        window = min(layer.sliding_window for layer in self.layers)
        for name in self.blocks:
            before = (self.length(name) - window + 1) // BLOCK
            self.dropped[name] = max(self.dropped.get(name, 0), before)


def reused_rows() -> int:
    """Rows of the latest decode step that took only their new token from the cache."""
    plan = _DecodePlan._last
    assert plan is not None
    return len(plan.lens) - len(plan.fresh)


def drive(requests: Requests) -> None:
    """Prefills, a mixed step, a chunk over cached context, a request finishing and one
    joining in a mixed step, and long runs of decodes across many blocks."""
    requests.step([("a", 11), ("b", 6)])
    requests.step([("a", 1), ("c", 9), ("b", 1)])  # decodes around a prefill
    requests.step([("a", 1), ("b", 1), ("c", 7)])  # c: a chunk over 9 cached tokens
    requests.decode(["a", "b", "c"], steps=9)
    requests.finish("b")
    requests.step([("c", 1), ("a", 1), ("d", 13)])
    requests.decode(["c", "a", "d"], steps=10)
    requests.decode(["a", "d"], steps=2)


@pytest.mark.parametrize("window", [3, 6, 8, 200])
def test_sliding_windows_match_dense_attention(path, window):
    """Windows under a block, not a multiple of the block size, a multiple of it, and
    longer than every request (plain causal attention)."""
    requests = Requests(both_backends(window))
    drive(requests)
    assert requests.features_mattered == (window < 40)


@pytest.mark.parametrize("window", [None, 5])
def test_softcaps_tame_large_logits(path, window):
    """Keys 30 times larger: scores of tens, capped at 4 (alone, and with a window)."""
    requests = Requests(both_backends(window, cap=4.0), key_gain=30.0)
    drive(requests)
    assert requests.features_mattered


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 1), (8, 2)])
def test_grouped_query_heads_with_both_features(path, heads, kv_heads):
    requests = Requests(both_backends(7, 10.0, heads, kv_heads), key_gain=8.0)
    drive(requests)
    assert requests.features_mattered


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.02, 0.5)])
def test_fp8_caches_with_both_features(path, scales):
    requests = Requests(both_backends(6, 8.0), cache_dtype=FP8_KV_DTYPE, scales=scales,
                        key_gain=8.0)
    drive(requests)
    assert requests.features_mattered


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_KV_DTYPE])
def test_blocks_before_the_window_are_never_read(path, cache_dtype):
    """Decodes, a decode beside a chunk, rows that change places and the decode copies
    gathered afresh read from the block holding each window's first key on."""
    requests = Requests(both_backends(5, 20.0), cache_dtype=cache_dtype)
    requests.step([("a", 14), ("b", 9)])
    for rows in ([("a", 1), ("b", 1)],) * 3 + ([("a", 1), ("b", 6)], [("b", 1), ("a", 1)]):
        requests.drop_blocks_before_windows()
        requests.step(rows)
    requests.step([("b", 1), ("c", 2), ("a", 1)])  # a mixed step: the copies start again
    for _ in range(9):
        requests.drop_blocks_before_windows()
        requests.decode(["b", "c", "a"])
    assert min(requests.dropped.values()) > 0


def test_copies_of_windowed_layers_stay_a_window_long_and_share_plans(monkeypatch):
    use_torch_ops(monkeypatch)  # the PyTorch path's internals
    """Gemma-style layers, windowed and global, over one step's plan: each row takes only
    its new token once the copies hold it, the windowed copies stop growing at a window's
    blocks while the global ones hold every token, and every layer matches."""
    monkeypatch.setattr(cpu_backend, "MIRROR_MIN_KV_ELEMENTS", 0)
    monkeypatch.setattr(cpu_backend, "MIRROR_STEP", 8)
    made: list[int] = []
    init = _DecodePlan.__init__

    def counted(self, *args):
        made.append(1)
        init(self, *args)

    monkeypatch.setattr(_DecodePlan, "__init__", counted)
    layers = [CpuAttentionBackend(6, 2, DIM, SCALE, sliding_window=w, logit_softcap=c)
              for w, c in ((6, None), (None, None), (6, 30.0), (None, 30.0))]
    requests = Requests(layers, num_blocks=96)
    requests.step([("a", 10), ("b", 3), ("c", 21)])
    requests.decode(["a", "b", "c"])
    made.clear()
    for _ in range(40):
        requests.decode(["a", "b", "c"])
        assert reused_rows() == 3
    assert len(made) == 40  # one plan a step for the four layers
    longest = requests.length("c")
    windowed, full = layers[0]._mirror, layers[1]._mirror
    assert windowed is not None and full is not None
    # a window of 6 spans 3 blocks at most: 12 tokens, 16 in steps of 8
    assert windowed.kv.shape[3] == 16 < longest <= full.kv.shape[3]
    assert requests.features_mattered


def test_long_prefills_in_pieces_with_a_window(monkeypatch):
    """Prefill pieces of a few queries each: each reads only the keys its queries see."""
    monkeypatch.setattr(cpu_backend, "SCORES_BUDGET", 6 * 12 * 3)
    requests = Requests(both_backends(9, 6.0), key_gain=6.0)
    requests.step([("a", 40), ("b", 3)])
    requests.step([("a", 23), ("b", 30)])
    requests.drop_blocks_before_windows()
    requests.step([("a", 17), ("b", 1)])
    assert requests.features_mattered


@pytest.mark.parametrize("window,cap,heads,kv_heads", [
    (None, None, 6, 2),
    (5, None, 6, 2),  # a window under two blocks
    (7, 10.0, 8, 1),  # with a softcap, one KV head for eight query heads
    (None, None, 4, 4),
])
def test_sinks_join_every_softmax(path, window, cap, heads, kv_heads):
    """Sinks (one logit per query head, around 2) through prefills, chunks, mixed steps
    and decodes, alone and with the other features; the decodes both ways."""
    requests = Requests(both_backends(window, cap, heads, kv_heads), key_gain=3.0,
                        sink_gain=1.5)
    drive(requests)
    assert requests.features_mattered


def test_sinks_over_an_fp8_cache_and_prefill_pieces(monkeypatch):
    monkeypatch.setattr(cpu_backend, "SCORES_BUDGET", 6 * 12 * 3)
    requests = Requests(both_backends(9), cache_dtype=FP8_KV_DTYPE, scales=(0.05, 0.1),
                        sink_gain=1.0)
    requests.step([("a", 40), ("b", 3)])
    requests.step([("a", 23), ("b", 30)])
    requests.decode(["a", "b"], steps=3)
    assert requests.features_mattered


def test_backends_refuse_sinks_of_the_wrong_shape():
    requests = Requests(both_backends(), sink_gain=1.0)
    requests.sinks = [torch.zeros(7)] * len(requests.layers)  # the layers have 6 heads
    with pytest.raises(ValueError, match=r"sinks must be a floating \[6\]"):
        requests.step([("a", 3)])
