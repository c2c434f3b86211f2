"""The step-input unpacking kernel against its PyTorch version (under the Triton
interpreter on the CPU), and both against what the packed layout means."""

from __future__ import annotations

import pytest
import torch

from vllmpy.ops.step_inputs import (
    StepTensors,
    layout,
    packed_size,
    unpack_step_inputs,
    unpack_step_inputs_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _packed(tokens: int, seqs: int, fills: dict[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    packed = torch.zeros(packed_size(tokens, seqs) + 3, dtype=torch.int32)
    lay = layout(tokens, seqs)

    def part(name: str) -> torch.Tensor:
        offset, length = lay[name]
        return packed[offset:offset + length]

    part("ids").copy_(torch.randint(0, 150_000, (tokens,), generator=g))
    part("positions").copy_(torch.randint(0, 4096, (tokens,), generator=g))
    part("slots").copy_(torch.randint(-1, 9000, (tokens,), generator=g))
    part("fill").fill_(-1)
    for row, src in fills.items():
        part("fill")[row] = src
    part("seq_lens").copy_(torch.randint(0, 40960, (seqs,), generator=g))
    part("query_start_loc").copy_(torch.sort(torch.randint(0, tokens + 1, (seqs + 1,),
                                                           generator=g)).values)
    part("logits_indices").copy_(torch.randint(0, tokens, (seqs,), generator=g))
    return packed.to(DEVICE)


@pytest.mark.parametrize("tokens,seqs,fills", [
    (1, 1, {0: 0}),  # batch 1: the token comes from the last step's only id
    (1, 1, {}),  # the host knows it (the first decode after a prefill)
    (8, 8, {0: 3, 2: 0, 4: 4}),  # some rows from the device, in another order
    (40, 3, {39: 2}),  # a mixed step: more tokens than requests
    (300, 300, {i: 299 - i for i in range(0, 300, 3)}),  # more than one program
])
def test_matches_reference_and_layout(tokens: int, seqs: int, fills: dict[int, int]) -> None:
    packed = _packed(tokens, seqs, fills, tokens + seqs)
    sampled = torch.arange(1000, 1000 + 400, dtype=torch.int64, device=DEVICE)
    kernel, ref = (StepTensors(512, 400, torch.device(DEVICE)) for _ in range(2))
    for t in (kernel, ref):
        t.input_ids.fill_(-7)
    unpack_step_inputs(packed, sampled, kernel, tokens, seqs)
    unpack_step_inputs_ref(packed, sampled, ref, tokens, seqs)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
                 "logits_indices"):
        assert torch.equal(getattr(kernel, name), getattr(ref, name)), name
    lay = layout(tokens, seqs)
    host = packed.cpu()

    def part(name: str) -> torch.Tensor:
        offset, length = lay[name]
        return host[offset:offset + length].long()

    # what the layout means, spelled out
    for row in range(tokens):
        want = 1000 + fills[row] if row in fills else int(part("ids")[row])
        assert int(kernel.input_ids[row]) == want
    assert torch.equal(kernel.positions[:tokens].cpu(), part("positions"))
    assert torch.equal(kernel.slot_mapping[:tokens].cpu(), part("slots"))
    assert torch.equal(kernel.seq_lens[:seqs].cpu().long(), part("seq_lens"))
    assert torch.equal(kernel.query_start_loc[:seqs + 1].cpu().long(), part("query_start_loc"))
    assert torch.equal(kernel.logits_indices[:seqs].cpu(), part("logits_indices"))
    assert kernel.input_ids.dtype == torch.int64 and kernel.seq_lens.dtype == torch.int32
    assert bool((kernel.input_ids[tokens:] == -7).all())  # rows past the step untouched


def test_refuses_bad_buffers() -> None:
    packed = _packed(4, 4, {}, 0)
    sampled = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    out = StepTensors(4, 4, torch.device(DEVICE))
    with pytest.raises(ValueError, match="packed must be a contiguous 1-D int32"):
        unpack_step_inputs(packed.long(), sampled, out, 4, 4)
    with pytest.raises(ValueError, match="does not fit buffers"):
        unpack_step_inputs(_packed(8, 4, {}, 0), sampled, out, 8, 4)
    with pytest.raises(ValueError, match="needs"):
        unpack_step_inputs(packed[:10], sampled, out, 4, 4)
    with pytest.raises(ValueError, match="sampled must be"):
        unpack_step_inputs(packed, sampled.int(), out, 4, 4)
