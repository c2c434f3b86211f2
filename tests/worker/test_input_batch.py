"""The persistent batch gathers exactly the inputs a per-token Python loop would."""

from __future__ import annotations

import numpy as np
import pytest

from vllmpy.worker.input_batch import InputBatch


def _loop_inputs(reqs: dict[str, dict], order: list[str], counts: list[int], bs: int):
    """The reference: one Python step per token."""
    ids, pos, slots, qsl, seq_lens, sample_rows = [], [], [], [0], [], []
    for i, (r, n) in enumerate(zip(order, counts)):
        req = reqs[r]
        start = req["computed"]
        for p in range(start, start + n):
            ids.append(req["tokens"][p])
            pos.append(p)
            slots.append(req["blocks"][p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        if start + n >= len(req["tokens"]):
            sample_rows.append(i)
    return ids, pos, slots, qsl, seq_lens, sample_rows


def _fill(batch: InputBatch, reqs: dict[str, dict]) -> None:
    for r, req in reqs.items():
        batch.add(r, req["tokens"], req["blocks"], req["computed"])


@pytest.mark.parametrize("counts", [[1, 1, 1], [5, 1, 3], [2, 7, 1]])
def test_prepare_matches_per_token_loop(counts: list[int]) -> None:
    rng = np.random.default_rng(0)
    bs = 4
    reqs = {
        "a": {"tokens": rng.integers(0, 1000, 9).tolist(), "blocks": [7, 3, 11], "computed": 8},
        "b": {"tokens": rng.integers(0, 1000, 12).tolist(), "blocks": [0, 5, 9], "computed": 4},
        "c": {"tokens": rng.integers(0, 1000, 6).tolist(), "blocks": [2, 4], "computed": 5},
    }
    # keep every chunk inside the known tokens
    order = ["b", "a", "c"]
    counts = [min(n, len(reqs[r]["tokens"]) - reqs[r]["computed"]) for r, n in zip(order, counts)]
    batch = InputBatch(max_num_reqs=4, max_model_len=16, block_size=bs)
    _fill(batch, reqs)
    step = batch.prepare(order, counts)
    ids, pos, slots, qsl, seq_lens, sample_rows = _loop_inputs(reqs, order, counts, bs)
    assert step.input_ids.tolist() == ids
    assert step.positions.tolist() == pos
    assert step.slot_mapping.tolist() == slots
    assert step.query_start_loc.tolist() == qsl
    assert step.seq_lens.tolist() == seq_lens
    assert step.sample_rows == sample_rows
    assert step.logits_indices.tolist() == [qsl[i + 1] - 1 for i in sample_rows]
    assert step.max_query_len == max(counts)
    for i, r in enumerate(order):
        blocks = reqs[r]["blocks"]
        assert step.block_tables[i, :len(blocks)].tolist() == blocks


def test_remove_moves_last_row_into_the_hole() -> None:
    batch = InputBatch(max_num_reqs=3, max_model_len=8, block_size=2)
    batch.add("a", [1, 2, 3], [0, 1], 2)
    batch.add("b", [4, 5], [2], 1)
    batch.add("c", [6, 7, 8, 9], [3, 4], 3)
    batch.remove("a")
    assert batch.req_ids == ["c", "b"]
    assert batch.index == {"c": 0, "b": 1}
    step = batch.prepare(["b", "c"], [1, 1])
    assert step.input_ids.tolist() == [5, 9]
    assert step.slot_mapping.tolist() == [2 * 2 + 1, 4 * 2 + 1]
    batch.remove("missing")  # a request that never ran: nothing to do
    assert len(batch) == 2


def test_appends_and_limits() -> None:
    batch = InputBatch(max_num_reqs=1, max_model_len=4, block_size=2)
    row = batch.add("a", [1, 2], [5], 2)
    batch.append_tokens(row, [3])
    batch.append_blocks(row, [6])
    step = batch.prepare(["a"], [1])
    assert step.input_ids.tolist() == [3]
    assert step.slot_mapping.tolist() == [6 * 2 + 0]
    with pytest.raises(ValueError, match="max_model_len=4"):
        batch.append_tokens(row, [4, 5])
    with pytest.raises(ValueError, match="at most 1 requests"):
        batch.add("b", [1], [0], 0)
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add("a", [1], [0], 0)
