"""A CPU bfloat16 product of many rows runs as a multiple of the row bucket and a
remainder (a bounded set of oneDNN kernels for steps of any token count): the result is
F.linear's, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllmpy.layers.linear import Linear
from vllmpy.layers.quantization.dense import CPU_BF16_ROW_BUCKET


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, CPU_BF16_ROW_BUCKET, CPU_BF16_ROW_BUCKET + 1, 200, 256])
def test_bucketed_rows_equal_f_linear(bias, rows):
    layer = Linear(40, 96, bias=bias)
    layer.bind_device(torch.device("cpu"))
    torch.manual_seed(rows)
    layer.weight = torch.nn.Parameter(torch.randn(96, 40, dtype=torch.bfloat16), False)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(96, dtype=torch.bfloat16), False)
    x = torch.randn(rows, 40, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
