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
- every one-token query of the step (the decodes) runs in one batched call, padded to the
  longest of them; a request with longer queries (a prefill or a chunk) runs on its own,
  its queries split into pieces whose scores stay under ``SCORES_BUDGET`` elements;
- a decode step that reads at most ``SERIAL_KV_ELEMENTS`` cached values runs on one
  thread: at that size, handing half of each copy to a second thread (which has to wake
  up and pull the data into its own cache) costs more than it saves. Measured on a 2-core
  x86 CPU inside a model's forward: a batch-1 decode layer went from about 130 to 90 us;
  at 8 requests of 92 tokens two threads were faster again.
"""

from __future__ import annotations

import torch

from vllmpy.attention.backend import FP8_KV_DTYPE, AttentionBackend, dequantize_kv, write_kv_cache
from vllmpy.attention.metadata import AttentionMetadata

# The most float32 scores one prefill piece holds at a time (16 MiB)
SCORES_BUDGET = 1 << 22
# Decode steps reading at most this many cached keys and values run on one thread
SERIAL_KV_ELEMENTS = 1 << 18
# torch.set_num_threads takes effect per call only with the OpenMP backend (the native
# thread pool keeps its first size and warns)
_OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


class CpuAttentionBackend(AttentionBackend):
    """The CPU backend. Same contract as ``AttentionBackend``; rows of q past
    ``meta.num_actual_tokens`` (padding) come back unspecified, and a request with no new
    tokens is skipped."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.group = num_heads // num_kv_heads
        self._no_bias: dict[torch.device, torch.Tensor] = {}  # baddbmm's ignored input

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                kv_stored: bool = False) -> torch.Tensor:
        num_tokens, scales, slots = meta.num_actual_tokens, (k_scale, v_scale), meta.slot_mapping
        if num_tokens < k.shape[0] or num_tokens < slots.shape[0]:  # padding writes nothing
            k, v, slots = k[:num_tokens], v[:num_tokens], slots[:num_tokens]
        starts = meta.query_start_loc_cpu
        decodes = [i for i in range(meta.num_reqs) if starts[i + 1] - starts[i] == 1]
        if len(decodes) == meta.num_reqs == q.shape[0]:  # a pure decode step, no padding
            threads = torch.get_num_threads()
            kv_elements = 2 * len(decodes) * max(meta.seq_lens_cpu) * k.shape[1] * k.shape[2]
            serial = _OPENMP and threads > 1 and kv_elements <= SERIAL_KV_ELEMENTS
            if serial:
                torch.set_num_threads(1)
            try:
                if not kv_stored:
                    write_kv_cache(k, v, kv_cache, slots, *scales)
                return self._decode(q, kv_cache, meta, decodes, scales).to(q.dtype)
            finally:
                if serial:
                    torch.set_num_threads(threads)
        if not kv_stored:
            write_kv_cache(k, v, kv_cache, slots, *scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if decodes:
            tokens = [starts[i] for i in decodes]
            attn = self._decode(q, kv_cache, meta, decodes, scales)  # [R, heads, dim]
            r = len(tokens)
            if tokens == list(range(tokens[0], tokens[0] + r)):
                out[tokens[0]:tokens[0] + r] = attn
            else:
                out[torch.tensor(tokens, device=q.device)] = attn.to(q.dtype)
        for i in range(meta.num_reqs):
            if starts[i + 1] - starts[i] > 1:
                self._prefill(q, kv_cache, meta, i, out, scales)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                rows: list[int], scales: tuple[float, float]) -> torch.Tensor:
        """Attention of the one-token queries of requests ``rows``, in one batch padded to
        the longest: float32 [len(rows), num_heads, head_dim]."""
        starts, dev = meta.query_start_loc_cpu, q.device
        lens = [meta.seq_lens_cpu[i] for i in rows]
        seq_len = max(lens)
        num_blocks = -(-seq_len // meta.block_size)
        r, first = len(rows), rows[0]
        kvh, group, dim = self.num_kv_heads, self.group, self.head_dim
        if rows == list(range(first, first + r)):
            table = meta.block_tables[first:first + r, :num_blocks]
            # one token each: consecutive rows (all of q in a pure decode step)
            query = q if r == q.shape[0] else q[starts[first]:starts[first] + r]
        else:
            table = meta.block_tables[torch.tensor(rows, device=dev), :num_blocks]
            query = q[torch.tensor([starts[i] for i in rows], device=dev)]
        keys, values = _gather(kv_cache, table, seq_len, q.dtype, scales)
        # [R, heads, dim] -> [R * kv_heads, group, dim]: batch index request * kv_heads + head
        query = _dense(query, torch.float32).view(r * kvh, group, dim)
        if min(lens) < seq_len:  # shorter requests mask the padded tail of their keys
            lengths = torch.tensor(lens, device=dev)
            past_end = torch.arange(seq_len, device=dev) >= lengths[:, None]  # [R, seq_len]
            bias = torch.zeros(r, kvh, 1, seq_len, device=dev)
            bias.masked_fill_(past_end[:, None, None, :], float("-inf"))
            bias, beta = bias.view(r * kvh, 1, seq_len), 1.0
        else:
            no_bias = self._no_bias.get(dev)
            if no_bias is None:
                no_bias = self._no_bias[dev] = torch.zeros(1, 1, 1, device=dev)
            bias, beta = no_bias, 0.0  # ignored with beta=0
        scores = torch.baddbmm(bias, query, keys.transpose(1, 2), beta=beta,
                               alpha=self.scale)  # [R * kv_heads, group, seq_len]
        attn = torch.bmm(torch.softmax(scores, dim=-1), values)  # [R * kv_heads, group, dim]
        return attn.view(r, self.num_heads, dim)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 i: int, out: torch.Tensor, scales: tuple[float, float]) -> None:
        """Causal attention of request ``i``'s queries (the last ``q_len`` of its
        ``seq_len`` tokens) over its cached keys, written into ``out``."""
        q_start, q_end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len, dev = meta.seq_lens_cpu[i], q.device
        context = seq_len - (q_end - q_start)  # tokens cached before this step
        num_blocks = -(-seq_len // meta.block_size)
        keys, values = _gather(kv_cache, meta.block_tables[i:i + 1, :num_blocks], seq_len,
                               q.dtype, scales)  # [kv_heads, seq_len, head_dim] each
        kvh, group, dim = self.num_kv_heads, self.group, self.head_dim
        piece = max(1, SCORES_BUDGET // (self.num_heads * seq_len))
        for lo in range(q_start, q_end, piece):
            hi = min(lo + piece, q_end)
            n = hi - lo
            visible = context + hi - q_start  # the last query of the piece sees this many keys
            # [n, heads, dim] -> [kv_heads, n * group, dim], rows ordered (token, group)
            query = _dense(q[lo:hi].reshape(n, kvh, group, dim).transpose(0, 1), torch.float32)
            positions = torch.arange(context + lo - q_start, context + hi - q_start, device=dev)
            future = torch.arange(visible, device=dev) > positions[:, None]  # [n, visible]
            bias = torch.zeros(n, group, visible, device=dev)
            bias.masked_fill_(future[:, None, :], float("-inf"))
            scores = torch.baddbmm(bias.view(1, n * group, visible),
                                   query.view(kvh, n * group, dim),
                                   keys[:, :visible].transpose(1, 2),
                                   alpha=self.scale)  # [kv_heads, n * group, visible]
            attn = torch.bmm(torch.softmax(scores, dim=-1), values[:, :visible])
            attn = attn.view(kvh, n, group, dim).transpose(0, 1)  # [n, kv_heads, group, dim]
            out[lo:hi].view(n, kvh, group, dim).copy_(attn)


def _gather(kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int, dtype: torch.dtype,
            scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first ``seq_len`` tokens in the blocks of ``table``
    [R, num_blocks], as float32 [R * kv_heads, seq_len, head_dim] each (batch index
    ``request * kv_heads + kv_head``). fp8 pages are dequantized to ``dtype`` first, as the
    reference does."""
    rows, kv_heads, head_dim = table.shape[0], kv_cache.shape[3], kv_cache.shape[4]
    pages = kv_cache.index_select(1, table.reshape(-1))  # [2, R * blocks, block, kvh, dim]
    # [2, R, kv_heads, seq_len, head_dim] (a view; the float32 copy below lays it out)
    pages = pages.view(2, rows, -1, kv_heads, head_dim).transpose(2, 3)[:, :, :, :seq_len]
    if kv_cache.dtype == FP8_KV_DTYPE:
        k_scale, v_scale = scales
        pages = torch.stack([dequantize_kv(pages[0], dtype, k_scale),
                             dequantize_kv(pages[1], dtype, v_scale)])
    keys, values = _dense(pages, torch.float32).view(2, rows * kv_heads, seq_len, head_dim)
    return keys, values


def _dense(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a contiguous tensor of ``dtype``, copied once at most (``Tensor.to`` with a
    memory format keeps the strides when the dtype already matches)."""
    if x.dtype == dtype:
        return x.contiguous()
    return x.to(dtype, memory_format=torch.contiguous_format)
