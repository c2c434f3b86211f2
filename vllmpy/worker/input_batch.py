"""The persistent batch: every running request's tokens and block table in preallocated
numpy arrays, updated by diffs, from which each step's inputs are gathered without a
Python loop over tokens.

Rows are dense: request ``i`` of ``req_ids`` lives in row ``i``; removing a request moves
the last row into the hole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepInputs:
    """One step's flattened inputs on the host (numpy), request order = scheduler order."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_tables: np.ndarray  # [num_reqs, max_blocks_in_step] int32
    logits_indices: np.ndarray  # [num_sampled] int64, rows of the hidden states to sample
    sample_rows: list[int]  # index into the step's requests of those that sample
    max_query_len: int
    max_seq_len: int
    # Tokens the host does not know yet (sampled by a step still in flight): their rows in
    # input_ids and the index of their request in the step.
    unknown_rows: list[int] = field(default_factory=list)
    unknown_reqs: list[int] = field(default_factory=list)
    # Speculative decoding: per sampling request (aligned with sample_rows) the drafts it
    # verifies, and the rows of the hidden states scored for it: its last drafts + 1
    # tokens, requests in order. None in a step without drafts.
    num_drafts: list[int] | None = None
    spec_logits_indices: np.ndarray | None = None
    # Hybrid models: [num_reqs] int32, each request's recurrent-state seat (None without)
    state_indices: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # each row's recurrent-state seat (-1: none; only hybrid models give seats)
        self.seats = np.full(max_num_reqs, -1, dtype=np.int32)
        self.req_ids: list[str] = []
        self.index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.req_ids)

    # ---- diffs ------------------------------------------------------------------------

    def add(self, req_id: str, token_ids: list[int], block_ids: list[int],
            num_computed: int, seat: int = -1) -> int:
        if req_id in self.index:
            raise ValueError(f"request {req_id!r} is already in the batch")
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise ValueError(f"the batch holds at most {self.max_num_reqs} requests")
        n = len(token_ids)
        if n > self.max_model_len:
            raise ValueError(f"request {req_id!r} has {n} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        self.req_ids.append(req_id)
        self.index[req_id] = row
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.seats[row] = seat
        self.append_blocks(row, block_ids)
        return row

    def remove(self, req_id: str) -> None:
        row = self.index.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:
            moved = self.req_ids[last]
            self.req_ids[row] = moved
            self.index[moved] = row
            n, nb = self.num_tokens[last], self.num_blocks[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.block_table[row, :nb] = self.block_table[last, :nb]
            self.num_tokens[row] = n
            self.num_blocks[row] = nb
            self.num_computed[row] = self.num_computed[last]
            self.seats[row] = self.seats[last]
        self.req_ids.pop()

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks:
            raise ValueError(f"request {self.req_ids[row]!r} would hold {end} blocks, more "
                             f"than the {self.max_blocks} of max_model_len")
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def set_drafts(self, row: int, token_ids: list[int]) -> None:
        """Write a request's draft tokens after its known ones (they stay unknown:
        ``num_tokens`` does not count them); a step's ``prepare`` reads them back."""
        n = int(self.num_tokens[row])
        if n + len(token_ids) > self.max_model_len:
            raise ValueError(f"request {self.req_ids[row]!r}: {len(token_ids)} drafts after "
                             f"{n} tokens exceed max_model_len={self.max_model_len}")
        self.token_ids[row, n:n + len(token_ids)] = token_ids

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        n = int(self.num_tokens[row])
        if n + len(token_ids) > self.max_model_len:
            raise ValueError(f"request {self.req_ids[row]!r} would exceed "
                             f"max_model_len={self.max_model_len}")
        self.token_ids[row, n:n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)

    # ---- one step ---------------------------------------------------------------------

    def prepare(self, req_ids: list[str], num_scheduled: list[int],
                num_drafts: list[int] | None = None,
                starts: np.ndarray | None = None) -> StepInputs:
        """Gather the step's inputs: request ``req_ids[i]`` computes ``num_scheduled[i]``
        tokens starting at its number of computed tokens (or at ``starts[i]``), the last
        ``num_drafts[i]`` of them its drafts (written by ``set_drafts``)."""
        rows = np.fromiter((self.index[r] for r in req_ids), dtype=np.int64,
                           count=len(req_ids))
        counts = np.asarray(num_scheduled, dtype=np.int64)
        if starts is None:
            starts = self.num_computed[rows].astype(np.int64)
        ends = starts + counts
        drafts = (None if num_drafts is None or not any(num_drafts)
                  else np.asarray(num_drafts, dtype=np.int64))
        bs = self.block_size
        if int(counts.max()) == 1 and int(counts.min()) == 1:  # a pure decode step
            tok_rows, positions = rows, starts
            tok_req = np.arange(len(rows))
            query_start = np.arange(len(rows) + 1, dtype=np.int32)
        else:
            total = int(counts.sum())
            cu = np.cumsum(counts)
            tok_req = np.repeat(np.arange(len(rows)), counts)
            offsets = np.arange(total, dtype=np.int64) - np.repeat(cu - counts, counts)
            tok_rows = rows[tok_req]
            positions = starts[tok_req] + offsets
            query_start = np.zeros(len(rows) + 1, dtype=np.int32)
            query_start[1:] = cu
        known = self.num_tokens[tok_rows]
        if drafts is not None:
            known = known + drafts[tok_req]
        input_ids = self.token_ids[tok_rows, np.minimum(positions, known - 1)].astype(np.int64)
        unknown = np.nonzero(positions >= known)[0]
        unknown_reqs = (unknown if len(rows) == len(positions)  # decode: token i is request i
                        else np.searchsorted(query_start[1:], unknown, side="right"))
        slots = (self.block_table[tok_rows, positions // bs].astype(np.int64) * bs
                 + positions % bs)
        # A request samples when this chunk reaches its last known token (or draft).
        samples = ends >= self.num_tokens[rows] + (0 if drafts is None else drafts)
        sample_rows = np.nonzero(samples)[0]
        logits_indices = query_start[1:][sample_rows].astype(np.int64) - 1
        spec_indices = None
        if drafts is not None:
            per = drafts[sample_rows] + 1
            spec_indices = (np.repeat(logits_indices - per + 1, per)
                            + np.arange(int(per.sum())) - np.repeat(np.cumsum(per) - per, per))
        seq_lens = ends.astype(np.int32)
        width = int(self.num_blocks[rows].max())
        seats = self.seats[rows]
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            query_start_loc=query_start,
            seq_lens=seq_lens,
            block_tables=self.block_table[rows, :max(width, 1)],
            logits_indices=logits_indices,
            sample_rows=sample_rows.tolist(),
            max_query_len=int(counts.max()),
            max_seq_len=int(ends.max()),
            unknown_rows=unknown.tolist(),
            unknown_reqs=np.asarray(unknown_reqs).tolist(),
            num_drafts=None if drafts is None else drafts[sample_rows].tolist(),
            spec_logits_indices=spec_indices,
            state_indices=seats if len(seats) and seats[0] >= 0 else None,
        )
