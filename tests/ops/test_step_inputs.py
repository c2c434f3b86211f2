"""The decode graph's input unpacking against its PyTorch reference (under the Triton
interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from vllmpy.ops import step_inputs
from vllmpy.ops.step_inputs import unpack_decode_inputs, unpack_decode_inputs_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _packed(seqs: int, fills: dict[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    packed = torch.zeros((step_inputs.NUM_ROWS, seqs), dtype=torch.int64)
    packed[step_inputs.IDS] = torch.randint(0, 150_000, (seqs,), generator=g)
    packed[step_inputs.POSITIONS] = torch.randint(0, 4096, (seqs,), generator=g)
    packed[step_inputs.SLOTS] = torch.randint(-1, 9000, (seqs,), generator=g)
    packed[step_inputs.FILL] = -1
    for row, src in fills.items():
        packed[step_inputs.FILL, row] = src
    packed[step_inputs.SEQ_LENS] = torch.randint(0, 40960, (seqs,), generator=g)
    return packed.to(DEVICE)


@pytest.mark.parametrize("seqs,size,fills", [
    (1, 1, {0: 0}),  # batch 1: the token comes from the last step's only id
    (1, 1, {}),  # the host knows it (the first decode after a prefill)
    (8, 5, {0: 3, 2: 0, 4: 4}),  # some rows from the device, in another order
    (300, 300, {i: 299 - i for i in range(0, 300, 3)}),  # more than one program
])
def test_matches_reference(seqs: int, size: int, fills: dict[int, int]) -> None:
    packed = _packed(seqs, fills, seqs + size)
    sampled = torch.arange(1000, 1000 + seqs, dtype=torch.int64, device=DEVICE)
    ids = torch.full((seqs,), -7, dtype=torch.int64, device=DEVICE)
    lens = torch.full((seqs,), -7, dtype=torch.int32, device=DEVICE)
    ids_ref, lens_ref = ids.clone(), lens.clone()
    unpack_decode_inputs(packed, sampled, ids, lens, size)
    unpack_decode_inputs_ref(packed, sampled, ids_ref, lens_ref, size)
    assert torch.equal(ids, ids_ref) and torch.equal(lens, lens_ref)
    # and what the reference means, spelled out for the rows the host does not know
    for row, src in fills.items():
        assert int(ids[row]) == 1000 + src
    for row in set(range(size)) - set(fills):
        assert int(ids[row]) == int(packed[step_inputs.IDS, row])
    assert torch.equal(lens[:size].long(), packed[step_inputs.SEQ_LENS, :size])
    # rows past `size` are untouched
    assert bool((ids[size:] == -7).all()) and bool((lens[size:] == -7).all())


def test_refuses_bad_buffers() -> None:
    packed = _packed(4, {}, 0)
    sampled = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    ids = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    lens = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="packed must be int64"):
        unpack_decode_inputs(packed.int(), sampled, ids, lens, 4)
    with pytest.raises(ValueError, match="seq_lens must be"):
        unpack_decode_inputs(packed, sampled, ids, lens.long(), 4)
    with pytest.raises(ValueError, match="outside the packed buffer"):
        unpack_decode_inputs(packed, sampled, ids, lens, 5)
    with pytest.raises(ValueError, match="need 4 rows"):
        unpack_decode_inputs(packed, sampled, ids[:2], lens, 4)
