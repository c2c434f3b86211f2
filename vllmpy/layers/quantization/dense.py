"""The unquantized method: a dense weight in the model's dtype.

On CUDA a one-row product (a batch-1 decode) streams the weight through
``vllmpy.ops.skinny_gemm``, where it beats cuBLAS on a decoder's matrices. On the CPU a
weight is packed once, at its first product (``pack_cpu``), and the packed copy takes the
dense copy's place: a float32 one into the C kernel's panels (``vllmpy.ops.cpu_dense``;
oneDNN's blocked layout where the C kernels are not built), a bfloat16 one (where oneDNN
has bfloat16 kernels) into oneDNN's. On an AMD Zen 3 the panels run a decode row about
1.3x faster than oneDNN and a prefill about even or better, and oneDNN 1.5-3.7x faster
than ``F.linear`` (MKL) at 2-16 rows. Both give a row the same sums whatever the call's
row count, so a speculative verify gets its decode step's bits (MKL's change with the
row count). A bfloat16 weight on a CPU whose oneDNN has no bfloat16 kernels goes through the
C kernel of ``vllmpy.ops.cpu_gguf`` instead (``cpu_bf16_rows``: bfloat16 reads, float32
products; PyTorch's bfloat16 matmul runs there at a fraction of the float32 rate).
Everything else is ``F.linear``. A checkpoint tensor that arrives quantized (a
GGUF shard this device keeps no kernel for) is dequantized into the weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vllmpy.layers.quantization.base import LinearMethod, copy_checked, new_param, shard_view
from vllmpy.ops import cpu_dense

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear

# a vocabulary-wide head is faster through cuBLAS than through the streaming kernel
SKINNY_MAX_OUTPUT = 32768


def cpu_packs(weight: torch.Tensor) -> bool:
    """Whether a weight multiplies through a packed copy (``pack_cpu``): bfloat16 on a CPU
    whose oneDNN has bfloat16 kernels, float32 where the C kernels are built or oneDNN
    runs."""
    if weight.device.type != "cpu":
        return False
    if weight.dtype == torch.bfloat16:
        return _MKLDNN_BF16
    return weight.dtype == torch.float32 and (_MKLDNN_FP32 or cpu_dense.available())


def cpu_packs_panels(weight: torch.Tensor) -> bool:
    """Whether ``pack_cpu`` packs this weight into the C kernel's float32 panels."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and cpu_dense.available())


def cpu_bf16_rows(weight: torch.Tensor) -> bool:
    """Whether a bfloat16 CPU weight multiplies through the C kernel (``cpu_gguf``'s BF16
    rows: the weight read as bfloat16, the products in float32; more rows than the
    kernel takes go through a transient float32 copy): a CPU whose oneDNN has no bfloat16
    kernels, where PyTorch's bfloat16 matmul runs far below the float32 rate."""
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or _MKLDNN_BF16
            or weight.dim() != 2 or not weight.is_contiguous()):
        return False
    from vllmpy.ops import cpu_gguf

    return cpu_gguf.supported("BF16", weight.shape[1], weight.device)


def bf16_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the C kernel (``cpu_bf16_rows``), in x's
    dtype, into ``out`` (2-D, rows contiguous) when given."""
    from vllmpy.ops import cpu_gguf

    lead = x.shape[:-1]
    y = cpu_gguf.linear(x.reshape(-1, x.shape[-1]), cpu_gguf.bf16_rows(weight), out)
    if bias is not None:
        y += bias
    return y if out is not None else y.reshape(*lead, weight.shape[0])


def pack_cpu(weight: torch.Tensor) -> Any:
    """``weight`` [out, in] packed for its CPU product (an opaque object that only
    ``packed_linear`` reads): float32 into the C kernel's panels where the kernels are
    built, else reordered for oneDNN's matmul."""
    if weight.dtype == torch.float32 and cpu_dense.available():
        return cpu_dense.pack(weight.detach())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: Any, bias: torch.Tensor | None,
                  out_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on a packed weight, for 2-D or batched ``x``; into ``out`` if given.
    oneDNN's products of more rows than ``CPU_BF16_ROW_BUCKET`` go as a multiple of it
    and a remainder: oneDNN builds (and caches) a kernel per shape, and a build costs more
    than a step's product, so steps of any token count reuse a bounded set of kernels."""
    if isinstance(packed, cpu_dense.PackedF32):
        if out is not None and (out.dim() != 2 or out.dtype != torch.float32
                                or out.stride(-1) != 1):
            return out.copy_(cpu_dense.linear(x, packed, bias))
        return cpu_dense.linear(x, packed, bias, out)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    tail = m % CPU_BF16_ROW_BUCKET
    if m > CPU_BF16_ROW_BUCKET and tail:
        y = torch.cat([_mkldnn_linear(x2[:m - tail], packed, bias),
                       _mkldnn_linear(x2[m - tail:], packed, bias)])
    else:
        y = _mkldnn_linear(x2, packed, bias)
    y = y.view(*lead, out_features)
    return y if out is None else out.copy_(y)


def _mkldnn_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _mkldnn_bf16() -> bool:
    try:
        return (torch.backends.mkldnn.is_available()
                and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


# CPU bfloat16 products of more rows than this run as a multiple of it and a remainder.
CPU_BF16_ROW_BUCKET = 64

_MKLDNN_BF16 = _mkldnn_bf16()
_MKLDNN_FP32 = (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class DenseMethod(LinearMethod):
    name = "dense"

    def __init__(self) -> None:
        self.skinny: Any = None  # vllmpy.ops.skinny_gemm, bound on CUDA
        self.packed: Any = None  # the packed copy on a CPU (``pack_cpu``)

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

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.streams_one_row(x):  # the layer's question, as the fused helpers ask it
            return self.skinny.skinny_gemm(x, layer.weight, layer.bias)
        if self.packed is not None or cpu_packs(layer.weight):
            if self.packed is None:  # loaded by now: the packed copy replaces the dense one
                self.packed = pack_cpu(layer.weight)
                layer.weight.data = layer.weight.new_empty(0)
            return packed_linear(x, self.packed, layer.bias, layer.output_size)
        if cpu_bf16_rows(layer.weight):
            return bf16_rows_linear(x, layer.weight, layer.bias)
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
