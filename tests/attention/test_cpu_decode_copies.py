"""The CPU backend's decode copies (``_DecodeMirror``) over many steps: every step's output
against the reference backend, while requests decode, cross block boundaries, finish,
change rows, join through prefills and reuse freed blocks."""

from __future__ import annotations

import math

import pytest
import torch

from vllmpy.attention import cpu_backend
from vllmpy.attention.backend import FP8_KV_DTYPE, TorchReferenceBackend
from attention.cpu_paths import use_torch_ops
from vllmpy.attention.cpu_backend import CpuAttentionBackend, _DecodePlan
from vllmpy.attention.metadata import AttentionMetadata

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 16


@pytest.fixture(autouse=True)
def copies_for_every_decode_step(monkeypatch):
    """These steps are small: keep copies for all of them (a test may set it back), on
    PyTorch's ops (the C kernels keep no copies)."""
    monkeypatch.setattr(cpu_backend, "MIRROR_MIN_KV_ELEMENTS", 0)
    use_torch_ops(monkeypatch)  # the copies are the PyTorch path's


class Engine:
    """Requests over one paged cache per layer, each step run through the CPU backend and
    the reference on copies of the same caches. Freed blocks go to the front of the free
    list, so the next request reuses them at once."""

    def __init__(self, num_blocks: int = 96, layers: int = 1, dtype=torch.float32,
                 cache_dtype=None, scales=(1.0, 1.0), seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.scales = dtype, scales
        cache_dtype = cache_dtype or dtype
        self.caches, self.ref_caches = [], []
        for _ in range(layers):
            cache = (torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=self.gen) * 2)
            cache = cache.to(cache_dtype)
            self.caches.append(cache)
            self.ref_caches.append(cache.clone())
        scale = 1 / math.sqrt(DIM)
        self.fast = [CpuAttentionBackend(HEADS, KV_HEADS, DIM, scale) for _ in range(layers)]
        self.ref = TorchReferenceBackend(HEADS, KV_HEADS, DIM, scale)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def finish(self, name: str) -> None:
        self.free[:0] = self.blocks.pop(name)
        del self.lens[name]

    def step(self, rows: list[tuple[str, int]]) -> None:
        """One step: ``rows`` lists (request, new tokens) in row order; a request not seen
        before starts with that many tokens. Checks every layer against the reference."""
        starts, slots, seq_lens = [0], [], []
        for name, new in rows:
            length = self.lens.get(name, 0) + new
            own = self.blocks.setdefault(name, [])
            while len(own) * BLOCK < length:
                own.append(self.free.pop(0))
            slots += [own[p // BLOCK] * BLOCK + p % BLOCK for p in range(length - new, length)]
            self.lens[name] = length
            starts.append(starts[-1] + new)
            seq_lens.append(length)
        width = max(len(self.blocks[name]) for name, _ in rows)
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, (name, _) in enumerate(rows):
            table[i, :len(self.blocks[name])] = torch.tensor(self.blocks[name])
        meta = AttentionMetadata(
            num_actual_tokens=starts[-1],
            query_start_loc=torch.tensor(starts, dtype=torch.int32), query_start_loc_cpu=starts,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), seq_lens_cpu=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=table,
            block_size=BLOCK, max_query_len=max(new for _, new in rows),
            max_seq_len=max(seq_lens))
        self.last = meta
        self.run(meta, rows)

    def run(self, meta: AttentionMetadata, rows) -> None:
        n = meta.num_actual_tokens
        for layer, (fast, cache, ref_cache) in enumerate(
                zip(self.fast, self.caches, self.ref_caches)):
            q, k, v = (torch.randn(n, h, DIM, generator=self.gen).to(self.dtype)
                       for h in (HEADS, KV_HEADS, KV_HEADS))
            expected = self.ref.forward(q, k, v, ref_cache, meta, *self.scales)
            out = fast.forward(q, k, v, cache, meta, *self.scales)
            tol = 2e-5 if self.dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol,
                                       msg=lambda m, layer=layer: f"layer {layer}, rows {rows}: {m}")

    def decode(self, names: list[str]) -> None:
        self.step([(name, 1) for name in names])


def reused_rows() -> int:
    """Rows of the latest decode step that took only their new token from the cache."""
    plan = _DecodePlan._last
    assert plan is not None
    return len(plan.lens) - len(plan.fresh)


def test_steady_decodes_add_one_token_a_row_and_match_the_reference():
    engine = Engine()
    engine.step([("a", 7), ("b", 1 + 2 * BLOCK), ("c", 3)])  # prefills
    engine.decode(["a", "b", "c"])  # the copies start: every row gathered
    assert reused_rows() == 0
    for _ in range(3 * BLOCK):  # across block boundaries
        engine.decode(["a", "b", "c"])
        assert reused_rows() == 3
    assert engine.fast[0]._mirror is not None and engine.fast[0]._mirror.serial


def test_rows_that_change_hands_are_gathered_again():
    engine = Engine()
    engine.step([("a", 9), ("b", 9), ("c", 5), ("d", 12)])
    engine.decode(["a", "b", "c", "d"])
    engine.decode(["a", "b", "c", "d"])
    assert reused_rows() == 4
    # a and b have equal lengths: swapped, each row sees one token more than it held,
    # but under another request's blocks
    engine.decode(["b", "a", "c", "d"])
    assert reused_rows() == 2
    # b finishes and the last row moves into its place (the batch stays dense)
    engine.finish("b")
    engine.decode(["d", "a", "c"])
    assert reused_rows() == 2  # a and c stayed in their rows
    engine.decode(["d", "a", "c"])
    assert reused_rows() == 3
    # the longest request leaves: the block table gets narrower
    engine.finish("d")
    engine.decode(["c", "a"])
    engine.decode(["c", "a"])
    assert reused_rows() == 2


def test_a_row_that_did_not_grow_by_one_token_is_gathered_again():
    """The same step run again (its cache changed at an old position in between): the rows
    hold as many tokens as the step has, not one fewer, so they are read afresh."""
    engine = Engine()
    engine.step([("a", 6), ("b", 9)])
    engine.decode(["a", "b"])
    engine.decode(["a", "b"])
    assert reused_rows() == 2
    for cache in engine.caches + engine.ref_caches:
        cache[:, engine.blocks["a"][0]] = 3.0  # a's first tokens, already copied
    engine.run(engine.last, "again")
    assert reused_rows() == 0


def test_a_mixed_step_drops_the_copies_and_freed_blocks_are_reused_safely():
    engine = Engine()
    engine.step([("a", 6), ("b", 10)])
    for _ in range(3):
        engine.decode(["a", "b"])
    # a finishes; e takes a's blocks in a step that also decodes b
    engine.finish("a")
    engine.step([("b", 1), ("e", 9)])
    assert engine.fast[0]._mirror.serial == 0  # forgotten: the prefill wrote the cache
    engine.decode(["e", "b"])  # e now sits where a was, in a's blocks
    assert reused_rows() == 0
    engine.decode(["e", "b"])
    assert reused_rows() == 2


def count_plans(monkeypatch) -> list[int]:
    made: list[int] = []
    init = _DecodePlan.__init__

    def counted(self, *args):
        made.append(1)
        init(self, *args)

    monkeypatch.setattr(_DecodePlan, "__init__", counted)
    return made


def test_layers_share_one_plan_and_read_their_own_caches(monkeypatch):
    made = count_plans(monkeypatch)
    engine = Engine(layers=3)
    engine.step([("a", 5), ("b", 11)])
    engine.decode(["a", "b"])
    for _ in range(1, 2 * BLOCK):
        engine.decode(["a", "b"])
        assert reused_rows() == 2
    assert len(made) == 2 * BLOCK  # one a step, for three layers
    serials = {fast._mirror.serial for fast in engine.fast}
    assert len(serials) == 1 and serials != {0}


def test_a_layer_whose_copies_went_another_way_works_out_its_own_plan(monkeypatch):
    engine = Engine(layers=2)
    engine.step([("a", 5), ("b", 11)])
    engine.decode(["a", "b"])
    engine.decode(["a", "b"])
    engine.fast[1]._mirror.forget()  # as if layer 1 had seen a different step
    made = count_plans(monkeypatch)
    engine.decode(["a", "b"])  # layer 0 reuses its rows, layer 1 gathers them again
    assert len(made) == 2 and reused_rows() == 0
    assert engine.fast[0]._mirror.serial != engine.fast[1]._mirror.serial
    engine.decode(["a", "b"])  # both reuse their rows, each by its own plan
    assert len(made) == 4 and reused_rows() == 2


def test_the_copies_grow_and_keep_what_they_hold(monkeypatch):
    monkeypatch.setattr(cpu_backend, "MIRROR_STEP", 8)
    engine = Engine()
    engine.step([("a", 6), ("b", 3)])
    engine.decode(["a", "b"])
    capacities = []
    for _ in range(12):
        engine.decode(["a", "b"])
        capacities.append(engine.fast[0]._mirror.kv.shape[3])
        assert reused_rows() == 2
    assert capacities[0] == 8 and capacities[-1] == 24
    engine.step([("c", 2)])  # a prefill alone
    engine.decode(["a", "b", "c"])  # one more row than the copies hold
    engine.decode(["a", "b", "c"])
    assert reused_rows() == 3 and engine.fast[0]._mirror.kv.shape[1] == 3


@pytest.mark.parametrize("cache_dtype, copies", [(torch.float32, True),
                                                  (torch.bfloat16, False)])
def test_no_copies_that_would_take_more_memory_than_the_cache(cache_dtype, copies):
    """Two rows of 64 float32 tokens take 512 token-floats; a cache of 192 tokens holds
    768 of them in float32, 384 in bfloat16."""
    engine = Engine(num_blocks=48, cache_dtype=cache_dtype)
    engine.step([("a", 40), ("b", 30)])
    for _ in range(3):
        engine.decode(["a", "b"])
        assert (engine.fast[0]._mirror is not None) == copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_and_bfloat16_caches_read_their_new_tokens_as_the_gather_does(dtype):
    cache_dtype = FP8_KV_DTYPE if dtype == torch.float32 else torch.bfloat16
    engine = Engine(num_blocks=192, dtype=dtype, cache_dtype=cache_dtype, scales=(0.02, 0.5))
    engine.step([("a", 7), ("b", 2)])
    for _ in range(2 * BLOCK):
        engine.decode(["a", "b"])
    assert reused_rows() == 2


def test_small_decode_steps_gather_and_drop_the_copies(monkeypatch):
    engine = Engine()
    engine.step([("a", 7), ("b", 5)])
    engine.decode(["a", "b"])
    engine.decode(["a", "b"])
    assert reused_rows() == 2
    # the next step pads both rows to a's 10 tokens, keys and values
    monkeypatch.setattr(cpu_backend, "MIRROR_MIN_KV_ELEMENTS", 2 * 2 * 10 * KV_HEADS * DIM)
    made = count_plans(monkeypatch)
    engine.decode(["a", "b"])  # at the limit: gathered, the copies forgotten
    assert made == [] and engine.fast[0]._mirror.serial == 0
    engine.decode(["a", "b"])  # one value over it: the copies again, gathered afresh
    assert made == [1] and reused_rows() == 0
    engine.decode(["a", "b"])
    assert reused_rows() == 2
