"""Paged attention for the CPU, built for the small steps of decoding.

``CpuAttentionBackend`` keeps the contract and the results of ``TorchReferenceBackend`` (up
to rounding) and spends fewer, cheaper ops on each step:

- one ``index_select`` gathers the blocks of a step's requests, keys and values together,
  and one copy lays them out per KV head in float32;
- grouped-query heads are a [..., kv_heads, group, head_dim] view of the queries (no
  ``repeat_interleave``), so each KV head is read once for its whole group;
- scores, softmax and the weighted sum run in float32 through ``baddbmm``/``bmm``, with the
  scale and the mask folded into the ``baddbmm`` (small float32 matrix products are several
  times faster than bfloat16 ones on the CPU, and round less);
- with the C kernels (``ops/cpu_kernels``), every request of at most ``NATIVE_QUERY_ROWS``
  new tokens (decodes, speculative verifies) runs through them one query row at a time,
  so a verified draft gets the bits its own decode step would; without them,
- every one-token query of the step (the decodes) runs in one batched call, padded to the
  longest of them; a request with longer queries (a prefill or a chunk) runs on its own,
  its queries split into pieces whose scores stay under ``SCORES_BUDGET`` elements;
- a pure decode step that reads more than ``MIRROR_MIN_KV_ELEMENTS`` cached values keeps
  float32 copies of its requests' keys and values for the next step (``_DecodeMirror``,
  one per layer): a request that goes on decoding in the same row adds only its new
  token, and the matrix products read the copies in place, where the gather above would
  copy and convert every cached token again. Any other step drops the copies. They take
  at most as much memory as the paged cache itself; past that the step gathers. A
  batch-1 step keeps gathering: there the copies' bookkeeping costs more than the gather
  (docs/perf-log/cpu-decode.md, "CPU: decode copies");
- a decode step that reads at most ``SERIAL_KV_ELEMENTS`` cached values runs on one
  thread: at that size, handing half of each copy to a second thread (which has to wake
  up and pull the data into its own cache) costs more than it saves;
- a sliding window is read from the block holding the first key a query sees, so a long
  request costs a window's work: decodes gather from there, prefill pieces read the keys
  their queries see, and the decode copies of a row are a ring of a window's blocks. A
  softcap caps the scores before the mask is added. Sinks (a logit per query head in
  every softmax denominator) replace the softmax of those rows with ``sink_softmax``.
  None of them adds work when it is off.
"""

from __future__ import annotations

import itertools
import math
import weakref

from typing import Any

import torch
import torch.nn.functional as F

from vllmpy.attention.backend import (
    FP8_KV_DTYPE,
    AttentionBackend,
    check_sinks,
    dequantize_kv,
    sink_softmax,
    write_kv_cache,
)
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.ops import cpu_kernels

# Query dtypes whose prefills go through PyTorch's fused attention (float16 keeps the
# float32 score path)
SDPA_DTYPES = (torch.float32, torch.bfloat16)
# The most float32 scores one prefill piece holds at a time (16 MiB)
SCORES_BUDGET = 1 << 22
# Requests with at most this many new tokens (a decode, a speculative verify) run through
# the C kernel one query row at a time, so a verified draft token sees the arithmetic its
# one-token decode would have
NATIVE_QUERY_ROWS = 16
# Decode steps reading at most this many cached keys and values run on one thread
SERIAL_KV_ELEMENTS = 1 << 18
# Decode steps reading more cached keys and values than this keep copies of them
# (``_DecodeMirror``); below it a fresh gather costs less than keeping them
MIRROR_MIN_KV_ELEMENTS = 1 << 18
# The decode copies (``_DecodeMirror``) grow their length in steps of this many tokens
MIRROR_STEP = 64
# torch.set_num_threads takes effect per call only with the OpenMP backend (the native
# thread pool keeps its first size and warns)
_OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


class CpuAttentionBackend(AttentionBackend):
    """The CPU backend. Same contract as ``AttentionBackend``; rows of q past
    ``meta.num_actual_tokens`` (padding) come back unspecified, and a request with no new
    tokens is skipped."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None,
                 logit_softcap: float | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window,
                         logit_softcap)
        self.group = num_heads // num_kv_heads
        self._no_bias: dict[torch.device, torch.Tensor] = {}  # baddbmm's ignored input
        self._mirror: _DecodeMirror | None = None
        self._kernels: Any = None  # the C kernels' library, False without it

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens, scales, slots = meta.num_actual_tokens, (k_scale, v_scale), meta.slot_mapping
        check_sinks(sinks, self.num_heads)
        # [kv_heads, group, 1]: each query head's sink, beside its rows of the scores
        sinks = None if sinks is None else sinks.float().view(self.num_kv_heads, self.group, 1)
        if num_tokens < k.shape[0] or num_tokens < slots.shape[0]:  # padding writes nothing
            k, v, slots = k[:num_tokens], v[:num_tokens], slots[:num_tokens]
        starts = meta.query_start_loc_cpu
        native = self._native_rows(q, kv_cache)
        if native is not None:
            short = [i for i in range(meta.num_reqs)
                     if 0 < starts[i + 1] - starts[i] <= NATIVE_QUERY_ROWS]
            if len(short) == meta.num_reqs:
                if not kv_stored:
                    write_kv_cache(k, v, kv_cache, slots, *scales)
                out = torch.empty_like(q)
                self._native_decode(native, q, kv_cache, meta, short, sinks, out)
                return out
        decodes = [i for i in range(meta.num_reqs) if starts[i + 1] - starts[i] == 1]
        if len(decodes) == meta.num_reqs == q.shape[0]:  # a pure decode step, no padding
            threads = torch.get_num_threads()
            longest = max(meta.seq_lens_cpu)
            if self.sliding_window is not None:  # a window's blocks hold fewer
                longest = min(longest, self.sliding_window + meta.block_size - 1)
            kv_elements = 2 * len(decodes) * longest * k.shape[1] * k.shape[2]
            serial = _OPENMP and threads > 1 and kv_elements <= SERIAL_KV_ELEMENTS
            if serial:
                torch.set_num_threads(1)
            try:
                if not kv_stored:
                    write_kv_cache(k, v, kv_cache, slots, *scales)
                if kv_elements > MIRROR_MIN_KV_ELEMENTS:
                    return self._decode_step(q, kv_cache, meta, scales, sinks).to(q.dtype)
                if self._mirror is not None:
                    self._mirror.forget()
                return self._decode(q, kv_cache, meta, decodes, scales, sinks).to(q.dtype)
            finally:
                if serial:
                    torch.set_num_threads(threads)
        if self._mirror is not None:  # this step's writes are not in the copies
            self._mirror.forget()
        if not kv_stored:
            write_kv_cache(k, v, kv_cache, slots, *scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if native is not None:
            if short:
                self._native_decode(native, q, kv_cache, meta, short, sinks, out)
            decodes = short
        elif decodes:
            tokens = [starts[i] for i in decodes]
            attn = self._decode(q, kv_cache, meta, decodes, scales, sinks)  # [R, heads, dim]
            r = len(tokens)
            if tokens == list(range(tokens[0], tokens[0] + r)):
                out[tokens[0]:tokens[0] + r] = attn
            else:
                out[torch.tensor(tokens, device=q.device)] = attn.to(q.dtype)
        fused = (sinks is None and self.logit_softcap is None and self.sliding_window is None
                 and q.dtype in SDPA_DTYPES)
        done = set(decodes)
        for i in range(meta.num_reqs):
            if starts[i + 1] - starts[i] > 1 and i not in done:
                if fused:
                    self._prefill_sdpa(q, kv_cache, meta, i, out, scales)
                else:
                    self._prefill(q, kv_cache, meta, i, out, scales, sinks)
        return out

    def _native_rows(self, q: torch.Tensor, kv_cache: torch.Tensor) -> Any:
        """The C kernels' library when they take this step's decodes (a cache and queries
        of a dtype they read, heads contiguous), else None."""
        if self._kernels is None:
            self._kernels = cpu_kernels.kernels() or False
        if (self._kernels is False or cpu_kernels.code(kv_cache.dtype) is None
                or cpu_kernels.code(q.dtype) is None or q.stride(-1) != 1):
            return None
        return self._kernels

    def _native_decode(self, lib: Any, q: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, rows: list[int],
                       sinks: torch.Tensor | None, out: torch.Tensor) -> None:
        """The queries of requests ``rows`` through the C kernel, which reads the cache
        blocks in place, one query row at a time (each over the keys up to its own
        position): written into their rows of ``out``."""
        index = _DecodeIndex.for_step(meta, rows)
        work = 2 * sum(index.lens) * self.num_kv_heads * self.head_dim
        threads = 1 if work <= SERIAL_KV_ELEMENTS else torch.get_num_threads()
        flat_sinks = None if sinks is None else sinks.reshape(-1).contiguous()
        cpu_kernels.decode_attention(
            lib, q, kv_cache, meta.block_tables, index.rows, index.tokens, index.seq_lens,
            self.scale, self.logit_softcap, self.sliding_window, flat_sinks, out, threads)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                rows: list[int], scales: tuple[float, float],
                sinks: torch.Tensor | None) -> torch.Tensor:
        """Attention of the one-token queries of requests ``rows``, in one batch padded to
        the longest: float32 [len(rows), num_heads, head_dim]."""
        starts, dev = meta.query_start_loc_cpu, q.device
        lens = [meta.seq_lens_cpu[i] for i in rows]
        seq_len = max(lens)
        num_blocks = -(-seq_len // meta.block_size)
        r, first = len(rows), rows[0]
        window = self.sliding_window  # None too when it hides no key of this step
        window = window if window is not None and seq_len > window else None
        cols = slice(num_blocks) if window is None else slice(None)
        if rows == list(range(first, first + r)):
            table = meta.block_tables[first:first + r, cols]
            # one token each: consecutive rows (all of q in a pure decode step)
            query = q if r == q.shape[0] else q[starts[first]:starts[first] + r]
        else:
            table = meta.block_tables[torch.tensor(rows, device=dev), cols]
            query = q[torch.tensor([starts[i] for i in rows], device=dev)]
        if window is not None:
            table, seq_len, bias = self._window_decode(table, lens, window, meta.block_size)
        else:
            bias = self._length_bias(lens, dev)
        keys, values = _gather(kv_cache, table, seq_len, q.dtype, scales)
        return self._attend(query, keys, values, seq_len, bias, sinks)

    def _window_decode(self, table: torch.Tensor, lens: list[int], window: int,
                       block_size: int) -> tuple[torch.Tensor, int, tuple[torch.Tensor, float]]:
        """For one-token queries of requests ``lens`` long with blocks ``table``: each
        row's blocks from the one holding its window's first key, the tokens they span
        (the longest row's) and the bias that hides the keys outside each window."""
        firsts = [max(0, n - window) // block_size for n in lens]
        ends = [n - f * block_size for n, f in zip(lens, firsts)]  # each row's length there
        seq_len = max(ends)
        table = _window_table(table, firsts, -(-seq_len // block_size))
        spans = [min(n, window) for n in lens]
        return table, seq_len, (_window_bias(ends, spans, seq_len, self.num_kv_heads,
                                             table.device), 1.0)

    def _decode_step(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scales: tuple[float, float], sinks: torch.Tensor | None) -> torch.Tensor:
        """A pure decode step (one query row per request, in order): from the copies kept
        since the last step when they have room, else gathered. float32 [R, heads, dim]."""
        mirror, window = self._mirror, self.sliding_window
        if mirror is None or not mirror.fits(kv_cache, meta, window):
            mirror = self._mirror = _DecodeMirror.sized_for(kv_cache, meta, mirror, window)
            if mirror is None:
                return self._decode(q, kv_cache, meta, list(range(meta.num_reqs)), scales,
                                    sinks)
        plan = _DecodePlan.for_step(meta, mirror)
        keys, values = mirror.apply(plan, kv_cache, scales, q.dtype, window)
        capacity = mirror.kv.shape[3]
        return self._attend(q, keys, values, min(plan.longest, capacity),
                            plan.length_bias(self, capacity), sinks)

    def _length_bias(self, lens: list[int], device: torch.device
                     ) -> tuple[torch.Tensor, float]:
        """baddbmm's (input, beta) for one-token queries of requests ``lens`` long: -inf
        past each request's length, or an ignored input when all have the same length."""
        if min(lens) < max(lens):
            return _past_end_bias(lens, self.num_kv_heads, device), 1.0
        no_bias = self._no_bias.get(device)
        if no_bias is None:
            no_bias = self._no_bias[device] = torch.zeros(1, 1, 1, device=device)
        return no_bias, 0.0  # ignored with beta=0

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                seq_len: int, bias: tuple[torch.Tensor, float],
                sinks: torch.Tensor | None) -> torch.Tensor:
        """One-token queries [R, heads, dim] over the first ``seq_len`` of float32 keys and
        values [R * kv_heads, >= seq_len, head_dim] (any strides within a batch entry),
        with ``bias`` from ``_length_bias`` and the layer's ``sinks`` ([kv_heads, group,
        1] float32, or None): float32 [R, heads, dim]."""
        r, kvh, group, dim = query.shape[0], self.num_kv_heads, self.group, self.head_dim
        keys, values = keys[:, :seq_len], values[:, :seq_len]
        # [R, heads, dim] -> [R * kv_heads, group, dim]: batch index request * kv_heads + head
        query = _dense(query, torch.float32).view(r * kvh, group, dim)
        scores = self._scores(bias, query, keys.transpose(1, 2))  # [R * kvh, group, seq_len]
        if sinks is None:
            weights = torch.softmax(scores, dim=-1)
        else:  # per (request, kv head, group row)
            weights = sink_softmax(scores.view(r, kvh, group, -1), sinks).view(scores.shape)
        attn = torch.bmm(weights, values)  # [R * kv_heads, group, dim]
        return attn.view(r, self.num_heads, dim)

    def _scores(self, bias: tuple[torch.Tensor, float], query: torch.Tensor,
                keys_t: torch.Tensor) -> torch.Tensor:
        """``bias[1] * bias[0] + scores`` for float32 [B, rows, dim] queries and [B, dim,
        len] keys, the scores ``scale * q.k`` capped by the layer's softcap if it has one
        (before the bias: a capped -inf would not hide its key)."""
        cap = self.logit_softcap
        if cap is None:
            return torch.baddbmm(bias[0], query, keys_t, beta=bias[1], alpha=self.scale)
        scores = torch.bmm(query, keys_t).mul_(self.scale / cap).tanh_().mul_(cap)
        return scores.add_(bias[0]) if bias[1] else scores

    def _prefill_sdpa(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      i: int, out: torch.Tensor, scales: tuple[float, float]) -> None:
        """``_prefill``'s attention through PyTorch's fused CPU attention (flash attention
        in tiles, its softmax in float32, on q's dtype): one call per request in place of a
        score matrix and its masking, softmax and product, for layers without a window,
        soft-cap or sinks."""
        q_start, q_end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        context = seq_len - (q_end - q_start)  # tokens cached before this step
        pages = _pages(kv_cache, meta.block_tables[i:i + 1, :-(-seq_len // meta.block_size)],
                       seq_len, q.dtype, scales)  # [2, 1, kv_heads, seq_len, dim]
        keys, values = _dense(pages, q.dtype)
        query = q[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        mask = None
        if context:  # query j (at position context + j) sees keys 0 .. context + j
            positions = torch.arange(context, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device) <= positions[:, None]
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                              is_causal=not context, scale=self.scale,
                                              enable_gqa=self.group > 1)
        out[q_start:q_end].copy_(attn[0].transpose(0, 1))

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 i: int, out: torch.Tensor, scales: tuple[float, float],
                 sinks: torch.Tensor | None) -> None:
        """Causal attention of request ``i``'s queries (the last ``q_len`` of its
        ``seq_len`` tokens) over its cached keys, written into ``out``."""
        q_start, q_end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len, dev = meta.seq_lens_cpu[i], q.device
        context = seq_len - (q_end - q_start)  # tokens cached before this step
        num_blocks, window = -(-seq_len // meta.block_size), self.sliding_window
        offset = 0  # the position of the first key gathered: its first query's first key's
        if window is not None:
            offset = max(0, context - window + 1) // meta.block_size * meta.block_size
        keys, values = _gather(kv_cache,
                               meta.block_tables[i:i + 1, offset // meta.block_size:num_blocks],
                               seq_len - offset, q.dtype, scales)  # [kv_heads, keys, dim]
        kvh, group, dim = self.num_kv_heads, self.group, self.head_dim
        piece = max(1, SCORES_BUDGET // (self.num_heads * seq_len))
        if window is not None:  # n queries see at most n + window - 1 keys
            budget, w = SCORES_BUDGET // self.num_heads, window - 1
            piece = max(piece, (math.isqrt(w * w + 4 * budget) - w) // 2)
        for lo in range(q_start, q_end, piece):
            hi = min(lo + piece, q_end)
            n = hi - lo
            begin, end = offset, context + hi - q_start  # the keys the piece's queries see
            if window is not None:
                begin = max(offset, context + lo - q_start - window + 1)
            # [n, heads, dim] -> [kv_heads, n * group, dim], rows ordered (token, group)
            query = _dense(q[lo:hi].reshape(n, kvh, group, dim).transpose(0, 1), torch.float32)
            positions = torch.arange(context + lo - q_start, context + hi - q_start, device=dev)
            key_positions = torch.arange(begin, end, device=dev)
            hidden = key_positions > positions[:, None]  # [n, end - begin]
            if window is not None:
                hidden |= positions[:, None] - key_positions >= window
            bias = torch.zeros(n, group, end - begin, device=dev)
            bias.masked_fill_(hidden[:, None, :], float("-inf"))
            seen = slice(begin - offset, end - offset)  # those keys among the gathered ones
            scores = self._scores((bias.view(1, n * group, end - begin), 1.0),
                                  query.view(kvh, n * group, dim),
                                  keys[:, seen].transpose(1, 2))  # [kvh, n * group, keys]
            if sinks is None:
                weights = torch.softmax(scores, dim=-1)
            else:  # rows (token, group): [kv_heads, n, group, keys], sinks [kv_heads, 1, group, 1]
                weights = sink_softmax(scores.view(kvh, n, group, -1),
                                       sinks.unsqueeze(1)).view(scores.shape)
            attn = torch.bmm(weights, values[:, seen])
            attn = attn.view(kvh, n, group, dim).transpose(0, 1)  # [n, kv_heads, group, dim]
            out[lo:hi].view(n, kvh, group, dim).copy_(attn)


class _DecodeIndex:
    """The C decode kernel's int64 arguments for one step's query rows of requests
    ``rows`` (request, query token, keys it sees: its position + 1), made once per step:
    every layer sees the same metadata."""

    _last: _DecodeIndex | None = None

    def __init__(self, meta: AttentionMetadata, rows: list[int]) -> None:
        self.meta, self.key = weakref.ref(meta), rows
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        requests, tokens, self.lens = [], [], []
        for i in rows:
            first, n = starts[i], starts[i + 1] - starts[i]
            requests += [i] * n
            tokens += range(first, first + n)
            self.lens += range(lens[i] - n + 1, lens[i] + 1)
        self.rows = torch.tensor(requests, dtype=torch.int64)
        self.tokens = torch.tensor(tokens, dtype=torch.int64)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int64)

    @classmethod
    def for_step(cls, meta: AttentionMetadata, rows: list[int]) -> _DecodeIndex:
        index = cls._last
        if index is None or index.meta() is not meta or index.key != rows:
            index = cls._last = cls(meta, rows)
        return index


class _DecodeMirror:
    """float32 copies of the cached keys and values of a pure decode step's requests,
    kept for the next step: row ``r`` holds the first ``lens[r]`` tokens of the request in
    row ``r`` of the last step, read from the blocks ``table[r]``, token ``p`` at ``p``.
    With a sliding window a row holds the tokens of its window, token ``p`` at ``p`` modulo
    the copies' length (a ring as long as a window's blocks at most), and is read from
    the block holding its window's first key on.

    A row is reused when the request in that row of the new step has one token more and
    the same blocks under its old tokens. The same block under the same positions holds
    the same keys and values: between two pure decode steps the cache is written only at
    each request's new token, in a block no other running request reads. Other rows are
    gathered afresh. A step of any other kind calls ``forget``.
    """

    def __init__(self, kv: torch.Tensor, cache_ptr: int) -> None:
        self.kv = kv  # [2, rows, kv_heads, capacity, head_dim]: keys, values
        self.cache_ptr = cache_ptr  # the paged cache the copies came from
        self.serial = 0  # the plan applied last (0: nothing held)
        self.lens: list[int] = []  # tokens held per row
        self.table = torch.empty(0, 0, dtype=torch.int32)  # [rows, blocks], -1 past a row

    @classmethod
    def sized_for(cls, kv_cache: torch.Tensor, meta: AttentionMetadata,
                  old: _DecodeMirror | None, window: int | None) -> _DecodeMirror | None:
        """Copies with room for this step's requests, keeping what ``old`` holds; None
        when they would take more memory than the paged cache itself."""
        rows, longest = meta.num_reqs, _mirror_length(meta, window)
        capacity = -(-longest // MIRROR_STEP) * MIRROR_STEP
        if old is not None and old.cache_ptr == kv_cache.data_ptr():
            rows, capacity = max(rows, old.kv.shape[1]), max(capacity, old.kv.shape[3])
        else:
            old = None
        shape = (2, rows, kv_cache.shape[3], capacity, kv_cache.shape[4])
        if math.prod(shape) * 4 > kv_cache.numel() * kv_cache.element_size():
            return None
        mirror = cls(torch.zeros(shape, device=kv_cache.device), kv_cache.data_ptr())
        # copies of a window are as long as they get before a row goes round: growing
        # them never moves a token to another slot
        if old is not None and old.serial:
            _, held_rows, _, held, _ = old.kv.shape
            mirror.kv[:, :held_rows, :, :held] = old.kv
            mirror.serial, mirror.lens, mirror.table = old.serial, old.lens, old.table
        return mirror

    def fits(self, kv_cache: torch.Tensor, meta: AttentionMetadata,
             window: int | None) -> bool:
        return (kv_cache.data_ptr() == self.cache_ptr and meta.num_reqs <= self.kv.shape[1]
                and _mirror_length(meta, window) <= self.kv.shape[3])

    def forget(self) -> None:
        self.serial, self.lens = 0, []

    def apply(self, plan: _DecodePlan, kv_cache: torch.Tensor, scales: tuple[float, float],
              dtype: torch.dtype, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the rows up to ``plan``'s step (its new tokens already in the cache) and
        return keys and values as [R * kv_heads, capacity, head_dim] views."""
        kv, rows = self.kv, len(plan.lens)
        _, _, kvh, capacity, dim = kv.shape
        if plan.fresh and window is None:  # every token of these rows, the new one included
            pages = _pages(kv_cache, plan.fresh_table, plan.fresh_longest, dtype, scales)
            kv[:, plan.fresh_index, :, :plan.fresh_longest] = pages.to(kv.dtype)
        elif plan.fresh and window is not None:  # their windows' blocks, into ring slots
            table, targets = plan.ring_rows(window, kvh, capacity)
            pages = _pages(kv_cache, table, table.shape[1] * plan.block_size, dtype, scales)
            kv.view(2, -1, dim).index_copy_(1, targets,
                                            pages.reshape(2, -1, dim).to(kv.dtype))
        if len(plan.fresh) < rows:  # the new token of every row (the fresh ones get it twice)
            flat = kv_cache.view(2, -1, kvh, dim)
            new = _dequantized(flat.index_select(1, plan.slots), dtype, scales)  # as _pages
            kv.view(2, -1, dim).index_copy_(1, plan.positions(kvh, capacity),
                                            new.view(2, rows * kvh, dim).to(kv.dtype))
        self.serial, self.lens, self.table = plan.serial, plan.lens, plan.table
        both = kv[:, :rows].view(2, rows * kvh, capacity, dim)
        return both[0], both[1]


class _DecodePlan:
    """What one pure decode step does to every layer's copies (``_DecodeMirror``), worked
    out once: the layers of a step see the same metadata, and their copies went through
    the same steps. A layer whose copies did not (``serial`` differs) works out its own."""

    _serials = itertools.count(1)
    _last: _DecodePlan | None = None  # the plan of the latest step

    def __init__(self, meta: AttentionMetadata, mirror: _DecodeMirror) -> None:
        self.meta = weakref.ref(meta)
        self.after = mirror.serial  # the copies this plan starts from
        self.serial = next(self._serials)
        rows, lens, block, table = meta.num_reqs, meta.seq_lens_cpu, meta.block_size, \
            meta.block_tables
        self.lens, self.longest, self.block_size = lens, max(lens), block
        kept = min(rows, len(mirror.lens))
        self.fresh = list(range(kept, rows))
        if kept:
            old = mirror.table[:kept]
            now = table[:kept, :old.shape[1]]
            if now.shape[1] < old.shape[1]:  # a narrower table: the longest request left
                now = torch.nn.functional.pad(now, (0, old.shape[1] - now.shape[1]), value=-2)
            same_blocks = ((now == old) | (old < 0)).all(dim=1).tolist()
            self.fresh += [r for r in range(kept)
                           if not same_blocks[r] or lens[r] != mirror.lens[r] + 1]
            self.fresh.sort()
        self.fresh_longest = max((lens[r] for r in self.fresh), default=0)
        self.fresh_index = torch.tensor(self.fresh, dtype=torch.long, device=table.device)
        self.fresh_table = table[self.fresh_index, :-(-self.fresh_longest // block)]
        self.slots = meta.slot_mapping[:rows]
        blocks = -(-self.longest // block)
        past = torch.arange(blocks) * block >= torch.tensor(lens)[:, None]
        self.table = table[:rows, :blocks].masked_fill(past.to(table.device), -1)
        self._positions: dict[tuple[int, int], torch.Tensor] = {}
        self._bias: dict[tuple[int, int | None, int], tuple[torch.Tensor, float]] = {}
        self._rings: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_step(cls, meta: AttentionMetadata, mirror: _DecodeMirror) -> _DecodePlan:
        plan = cls._last
        if plan is None or plan.meta() is not meta or plan.after != mirror.serial:
            plan = cls._last = cls(meta, mirror)
        return plan

    def positions(self, kv_heads: int, capacity: int) -> torch.Tensor:
        """Where each row's new token goes in [rows * kv_heads * capacity] (row-major)."""
        key = (kv_heads, capacity)
        if key not in self._positions:
            at = torch.tensor(self.lens, device=self.slots.device) - 1  # [R]
            if self.longest > capacity:  # rings: a window's tokens modulo their length
                at %= capacity
            heads = torch.arange(len(self.lens) * kv_heads, device=at.device)  # r*kvh + h
            self._positions[key] = heads * capacity + at.repeat_interleave(kv_heads)
        return self._positions[key]

    def length_bias(self, backend: CpuAttentionBackend, capacity: int
                    ) -> tuple[torch.Tensor, float]:
        """baddbmm's (input, beta) over the first min(longest, capacity) slots of copies
        ``capacity`` long: hides what lies past each row's end or outside its window."""
        kvh, window = backend.num_kv_heads, backend.sliding_window
        if window is None or self.longest <= window:
            key: tuple[int, int | None, int] = (kvh, None, 0)
            if key not in self._bias:
                self._bias[key] = backend._length_bias(self.lens, self.slots.device)
            return self._bias[key]
        key = (kvh, window, capacity)
        if key not in self._bias:
            spans = [min(n, window) for n in self.lens]
            bias = _window_bias(self.lens, spans, min(self.longest, capacity), kvh,
                                self.slots.device, capacity)
            self._bias[key] = bias, 1.0
        return self._bias[key]

    def ring_rows(self, window: int, kv_heads: int, capacity: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For the fresh rows of copies with a window: their blocks from the one holding
        their window's first key [F, blocks], and where each of those blocks' tokens goes
        in [rows * kv_heads * capacity] (row, head, position modulo capacity), in the
        order of ``_pages``. A padded row's tokens past its end land on slots that its
        window hides until it writes them."""
        key = (window, kv_heads, capacity)
        if key not in self._rings:
            block, dev = self.block_size, self.slots.device
            lens = [self.lens[r] for r in self.fresh]
            firsts = [max(0, n - window) // block for n in lens]
            blocks = max(-(-n // block) - f for n, f in zip(lens, firsts))
            table = _window_table(self.fresh_table, firsts, blocks)  # [F, blocks]
            at = torch.tensor(firsts, device=dev)[:, None] * block + torch.arange(
                blocks * block, device=dev)  # [F, tokens]: the position of each token
            heads = self.fresh_index[:, None] * kv_heads + torch.arange(kv_heads, device=dev)
            targets = heads[:, :, None] * capacity + (at % capacity)[:, None, :]
            self._rings[key] = table, targets.reshape(-1)  # [F * kv_heads * tokens]
        return self._rings[key]


def _mirror_length(meta: AttentionMetadata, window: int | None) -> int:
    """The tokens a row of the decode copies needs for this step: the longest request's;
    with a window, its blocks' tokens up to those a window's blocks can hold."""
    longest, block = max(meta.seq_lens_cpu), meta.block_size
    if window is None:
        return longest
    return min(-(-longest // block) * block, (-(-window // block) + 1) * block)


def _window_table(table: torch.Tensor, firsts: list[int], num_blocks: int) -> torch.Tensor:
    """[R, num_blocks]: row r's blocks from column ``firsts[r]`` of ``table`` [R, width] on,
    past its last column repeating that one (tokens a bias hides)."""
    cols = torch.tensor(firsts, device=table.device)[:, None] + torch.arange(
        num_blocks, device=table.device)
    return table.gather(1, cols.clamp_(max=table.shape[1] - 1))


def _window_bias(ends: list[int], spans: list[int], length: int, kv_heads: int,
                 device: torch.device, capacity: int | None = None) -> torch.Tensor:
    """[R * kv_heads, 1, length]: 0 at the ``spans[r]`` slots before ``ends[r]`` in row
    r (going round a ring of ``capacity`` slots when given), -inf elsewhere."""
    back = torch.tensor(ends, device=device)[:, None] - 1 - torch.arange(length, device=device)
    if capacity is not None:
        back %= capacity  # [R, length]: how many tokens before the row's last one
    hidden = (back < 0) | (back >= torch.tensor(spans, device=device)[:, None])
    bias = torch.zeros(len(ends), kv_heads, 1, length, device=device)
    bias.masked_fill_(hidden[:, None, None, :], float("-inf"))
    return bias.view(len(ends) * kv_heads, 1, length)


def _past_end_bias(lens: list[int], kv_heads: int, device: torch.device) -> torch.Tensor:
    """[R * kv_heads, 1, max(lens)]: 0 within each request's length, -inf past it."""
    r, seq_len = len(lens), max(lens)
    past_end = torch.arange(seq_len, device=device) >= torch.tensor(lens, device=device)[:, None]
    bias = torch.zeros(r, kv_heads, 1, seq_len, device=device)
    bias.masked_fill_(past_end[:, None, None, :], float("-inf"))
    return bias.view(r * kv_heads, 1, seq_len)


def _pages(kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int, dtype: torch.dtype,
           scales: tuple[float, float]) -> torch.Tensor:
    """Keys and values of the first ``seq_len`` tokens in the blocks of ``table``
    [R, num_blocks], as [2, R, kv_heads, seq_len, head_dim] (a strided view of one copy).
    fp8 pages are dequantized to ``dtype``, as the reference does; others keep the cache's
    dtype."""
    rows, kv_heads, head_dim = table.shape[0], kv_cache.shape[3], kv_cache.shape[4]
    pages = kv_cache.index_select(1, table.reshape(-1))  # [2, R * blocks, block, kvh, dim]
    pages = pages.view(2, rows, -1, kv_heads, head_dim).transpose(2, 3)[:, :, :, :seq_len]
    return _dequantized(pages, dtype, scales)


def _dequantized(pair: torch.Tensor, dtype: torch.dtype,
                 scales: tuple[float, float]) -> torch.Tensor:
    """Keys and values stacked [2, ...] from the cache: fp8 ones dequantized to ``dtype``
    with their scales, others as they are."""
    if pair.dtype != FP8_KV_DTYPE:
        return pair
    return torch.stack([dequantize_kv(pair[0], dtype, scales[0]),
                        dequantize_kv(pair[1], dtype, scales[1])])


def _gather(kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int, dtype: torch.dtype,
            scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first ``seq_len`` tokens in the blocks of ``table``
    [R, num_blocks], as float32 [R * kv_heads, seq_len, head_dim] each (batch index
    ``request * kv_heads + kv_head``). fp8 pages are dequantized to ``dtype`` first, as the
    reference does."""
    pages = _pages(kv_cache, table, seq_len, dtype, scales)
    keys, values = _dense(pages, torch.float32).view(2, -1, seq_len, kv_cache.shape[4])
    return keys, values


def _dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a contiguous tensor of ``dtype``, copied once at most (``Tensor.to`` with a
    memory format keeps the strides when the dtype already matches)."""
    if x.dtype == dtype:
        return x.contiguous()
    return x.to(dtype, memory_format=torch.contiguous_format)
