"""The unquantized method: a dense weight in the model's dtype.

On CUDA a one-row product (a batch-1 decode) streams the weight through
``vllmpy.ops.skinny_gemm``, where it beats cuBLAS on a decoder's matrices; everything else
is ``F.linear``. A checkpoint tensor that arrives quantized (a GGUF shard this device keeps
no kernel for) is dequantized into the weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vllmpy.layers.quantization.base import LinearMethod, copy_checked, new_param, shard_view

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear

# a vocabulary-wide head is faster through cuBLAS than through the streaming kernel
SKINNY_MAX_OUTPUT = 32768

# CPU bfloat16 products of more rows than this run as a multiple of it and a remainder.
CPU_BF16_ROW_BUCKET = 64


class DenseMethod(LinearMethod):
    name = "dense"

    def __init__(self) -> None:
        self.skinny: Any = None  # vllmpy.ops.skinny_gemm, bound on CUDA

    def create_weights(self, layer: Linear) -> None:
        new_param(layer, "weight", (layer.output_size, layer.input_size), torch.float32,
                  keep_dtype=False)

    def load(self, layer: Linear, suffix: str, loaded: torch.Tensor, shard_id: Any,
             name: str) -> None:
        dst = shard_view(layer, layer.weight, shard_id, name)
        dense = getattr(loaded, "dense", None)
        if dense is not None:  # a block-quantized tensor, dequantized exactly as gguf-py
            if tuple(loaded.shape) != tuple(dst.shape):
                copy_checked(dst, loaded, name)  # names the mismatch
            loaded = dense(dst.dtype)
        copy_checked(dst, loaded, name)

    def load_dense(self, layer: Linear, weight: torch.Tensor) -> None:
        copy_checked(layer.weight, weight, "weight")

    def bind(self, layer: Linear, device: torch.device) -> None:
        if device.type == "cuda" and layer.output_size <= SKINNY_MAX_OUTPUT:
            from vllmpy.ops import skinny_gemm

            self.skinny = skinny_gemm

    def streams_one_row(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the weight-streaming kernel: one contiguous row on
        CUDA, a matrix narrower than a vocabulary."""
        return (self.skinny is not None and x.dim() == 2 and x.shape[0] == 1
                and x.stride(1) == 1)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.streams_one_row(x):  # the layer's question, as the fused helpers ask it
            return self.skinny.skinny_gemm(x, layer.weight, layer.bias)
        m = x.shape[0] if x.dim() == 2 else 0
        tail = m % CPU_BF16_ROW_BUCKET
        if (m > CPU_BF16_ROW_BUCKET and tail and x.dtype == torch.bfloat16
                and x.device.type == "cpu"):
            # oneDNN builds (and caches) a kernel per shape, and a build costs more than a
            # step's product: the rows go as a multiple of the bucket and a remainder
            # under it, so steps of any token count reuse a bounded set of kernels
            head, w, b = m - tail, layer.weight.t(), layer.bias
            out = x.new_empty(m, layer.weight.shape[0])
            for rows in (slice(0, head), slice(head, m)):
                if b is None:
                    torch.mm(x[rows], w, out=out[rows])
                else:
                    torch.addmm(b, x[rows], w, out=out[rows])
            return out
        return F.linear(x, layer.weight, layer.bias)
