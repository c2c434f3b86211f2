"""GGUF block-quantized weights: kept in their blocks where a kernel runs them.

A GGUF file's matrices come from the loader as ``QuantizedTensor`` (the blocks of one
matrix, standing for its dequantized weights). The method of each linear layer of a GGUF
model decides per shard, once the layer's shards are in:

* on CUDA, every block type of ``vllmpy.ops.gguf_quants`` stays in its blocks and runs
  through ``vllmpy.ops.gguf_gemm`` (a fused dequant-GEMV for decode rows, a dequant-GEMM
  for prefill);
* on the CPU in bfloat16, Q4_0 / Q4_1 run PyTorch's 4-bit matmul (``vllmpy.ops.cpu_int4``)
  and the k-quants ``vllmpy.ops.cpu_quant`` takes where it beats the dense matmul; every
  other case of a type ``vllmpy.ops.cpu_gguf`` knows (float32 above all, the README's
  default) stays in its blocks and runs through its C kernel (a tied head too, beside the
  dense embedding that serves the lookups);
* anything else is dequantized into a dense weight, exactly as gguf-py dequantizes it.

Shards of one packed layer that came in different types (a Q4_K_M file's Q4_K q/k beside
a Q6_K v) are kept as consecutive segments, each run by its own kernel into its columns of
one output. The embedding of a tied model can also serve as the output head in its own
type (``tied_head``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from vllmpy.layers.quantization.base import LinearMethod, QuantizationConfig, dtype_name

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear

# A head holding both a dense weight and a 4-bit copy (a tied head on the CPU) runs 4-bit
# for up to this many tokens, dense above: the 4-bit matmul reads fewer bytes but computes
# slower.
INT4_MAX_TOKENS_BESIDE_DENSE = 4


def block_geometry(quant_type: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGUF type; unknown types are refused."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType[quant_type]]
    except KeyError:
        raise ValueError(f"quantized tensor type {quant_type!r} is not supported; "
                         f"supported: {sorted(QUANT_TYPES)}") from None


# the block types a QuantizedTensor carries (every type the GGUF loader keeps in blocks)
QUANT_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                         "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"})


class QuantizedTensor(torch.Tensor):
    """One block-quantized matrix as a GGUF file stores it, in Hugging Face orientation.

    To everything that does not know about it, it is the dequantized [rows, cols] tensor of
    ``dtype``: any torch operation on it runs on ``dense()`` (so copying it into a
    parameter, ``.to()``, ``torch.equal`` all see the weights). A layer that knows reads
    ``quant_type`` and ``blocks`` instead and keeps the weight quantized.

    ``blocks`` is uint8 [rows, cols / block_weights * block_bytes]: row r holds the blocks
    of output row r, so rows can be selected or permuted freely (``with_blocks``).
    """

    quant_type: str
    blocks: torch.Tensor

    @staticmethod
    def __new__(cls, quant_type: str, shape: tuple[int, int], blocks: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> QuantizedTensor:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, shape, dtype=dtype, device=blocks.device)

    def __init__(self, quant_type: str, shape: tuple[int, int], blocks: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> None:
        if quant_type not in QUANT_TYPES:
            raise ValueError(f"quantized tensor type {quant_type!r} is not supported; "
                             f"supported: {sorted(QUANT_TYPES)}")
        per_block, block_bytes = block_geometry(quant_type)
        rows, cols = shape
        if cols % per_block != 0:
            raise ValueError(f"a {quant_type} tensor of shape {tuple(shape)} does not split "
                             f"into blocks of {per_block} along its {cols} columns")
        expected = (rows, cols // per_block * block_bytes)
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
            raise ValueError(f"{quant_type} blocks of shape {tuple(shape)} must be uint8 "
                             f"{expected}; got {blocks.dtype} {tuple(blocks.shape)}")
        self.quant_type = quant_type
        self.blocks = blocks

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"QuantizedTensor({self.quant_type}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        def unwrap(t: object) -> object:
            return t.dense() if isinstance(t, QuantizedTensor) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def with_blocks(self, blocks: torch.Tensor) -> QuantizedTensor:
        """The same type and dtype over other rows (``blocks`` [new_rows, bytes_per_row])."""
        return QuantizedTensor(self.quant_type, (blocks.shape[0], self.shape[1]), blocks,
                               self.dtype)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weights as a [rows, cols] ``dtype`` tensor, computed in float32 exactly as the
        ``gguf`` package (and llama.cpp) do, then rounded once to ``dtype`` (default: the
        tensor's own dtype)."""
        from vllmpy.ops.cpu_int4 import BLOCK_BYTES, split_blocks

        rows, cols = tuple(self.shape)
        blocks = self.blocks
        if self.quant_type in BLOCK_BYTES:  # the three simple types, in torch
            codes, d, m = split_blocks(blocks, self.quant_type, cols)
            if self.quant_type == "Q4_0":
                w = d * (codes.to(torch.int8) - 8).float()
            elif self.quant_type == "Q4_1":
                assert m is not None
                w = d * codes.float() + m
            else:
                w = codes.float() * d
            return w.reshape(rows, cols).to(dtype or self.dtype)
        import gguf

        array = gguf.quants.dequantize(blocks.cpu().numpy(),
                                       gguf.GGMLQuantizationType[self.quant_type])
        return torch.from_numpy(array.reshape(rows, cols)).to(blocks.device,
                                                              dtype or self.dtype)


def cuda_types() -> frozenset[str]:
    """The block types the CUDA kernels run in their blocks."""
    from vllmpy.ops.gguf_quants import BLOCK_SIZES

    return frozenset(BLOCK_SIZES)


@dataclass
class Segment:
    """Consecutive output rows of a layer run by one kernel: ``kind`` is "gguf" (blocks,
    Triton), "cpu_blocks" (blocks, the CPU's C kernel), "int4" (CPU 4-bit matmul),
    "cpu_quant" (a CPU k-quant kernel) or "dense"."""

    offset: int
    rows: int
    kind: str
    quant_type: str | None  # None for a weight that came dense (F16, F32, BF16)
    weight: Any  # GGUFWeight | Int4Weight | CpuQuantWeight | torch.Tensor

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "gguf":
            from vllmpy.ops.gguf_gemm import GEMV_MAX_M, gguf_linear

            if x.shape[0] <= GEMV_MAX_M:  # decode rows: the fused dequant-GEMV
                return gguf_linear(x, self.weight, out=out)
            # prefill: the blocks dequantized into a transient tile of the whole matrix,
            # then cuBLAS (the Triton dequant-GEMM does not build on every Triton release)
            y = F.linear(x, self.weight.dequantize(x.dtype))
            return y if out is None else out.copy_(y)
        if self.kind == "cpu_blocks":
            from vllmpy.ops import cpu_gguf

            return cpu_gguf.linear(x, self.weight, out)
        if self.kind == "int4":
            from vllmpy.ops.cpu_int4 import int4_linear

            y = int4_linear(x, self.weight)
        elif self.kind == "cpu_quant":
            from vllmpy.ops import cpu_quant

            y = cpu_quant.linear(x, self.weight)
        else:
            y = F.linear(x, self.weight)
        if out is None:
            return y
        return out.copy_(y)


def _segment_kind(quant_type: str | None, rows: int, cols: int, device: torch.device,
                  dtype: torch.dtype) -> str:
    """Where a block of rows runs (see the module docstring)."""
    if quant_type is None:
        return "dense"
    if device.type == "cuda":
        return "gguf" if quant_type in cuda_types() else "dense"
    from vllmpy.ops import cpu_gguf
    from vllmpy.ops.cpu_int4 import int4_supported

    if int4_supported(quant_type, rows, device, dtype):
        return "int4"
    try:
        from vllmpy.ops import cpu_quant
    except ImportError:
        cpu_quant = None  # type: ignore[assignment]
    if cpu_quant is not None and cpu_quant.supported(quant_type, rows, cols, dtype):
        return "cpu_quant"
    return "cpu_blocks" if cpu_gguf.supported(quant_type, cols, device) else "dense"


def _make_segment(offset: int, parts: list[torch.Tensor], kind: str, cols: int,
                  device: torch.device, dtype: torch.dtype) -> Segment:
    rows = sum(p.shape[0] for p in parts)
    first = parts[0]
    qtype = getattr(first, "quant_type", None)
    if kind == "dense":
        weight = torch.cat([p.dense(dtype) if isinstance(p, QuantizedTensor) else p.to(dtype)
                            for p in parts]).to(device)
        return Segment(offset, rows, kind, qtype, weight)
    blocks = torch.cat([p.blocks for p in parts]).to(device)
    if kind == "gguf":
        from vllmpy.ops.gguf_quants import prepare

        weight = prepare(blocks, qtype, rows, cols)
    elif kind == "cpu_blocks":
        from vllmpy.ops import cpu_gguf

        weight = cpu_gguf.make(blocks, qtype, rows, cols)
    elif kind == "int4":
        from vllmpy.ops.cpu_int4 import pack_int4

        weight = pack_int4(blocks, qtype, cols, dtype)
    else:
        from vllmpy.ops import cpu_quant

        weight = cpu_quant.pack(blocks, qtype, rows, cols, dtype)
    return Segment(offset, rows, kind, qtype, weight)


class GGUFLinearMethod(LinearMethod):
    """A linear layer of a GGUF model (see the module docstring)."""

    name = "gguf"

    def __init__(self) -> None:
        self.pending: dict[Any, torch.Tensor] = {}  # shard id -> its tensor, until finish
        self.segments: list[Segment] = []
        self.dense_beside: torch.Tensor | None = None  # a tied CPU head's embedding
        self.beside_above = INT4_MAX_TOKENS_BESIDE_DENSE  # tokens past which it serves
        self.dtype = torch.float32

    def create_weights(self, layer: Linear) -> None:
        """Nothing up front: a shard's storage follows the type it arrives in."""

    def checkpoint_names(self, layer: Linear) -> tuple[str, ...]:
        return ("weight",)

    def load(self, layer: Linear, suffix: str, loaded: torch.Tensor, shard_id: Any,
             name: str) -> None:
        rows = (layer.shard_offsets[shard_id][1] if shard_id is not None
                else layer.output_size)
        if tuple(loaded.shape) != (rows, layer.input_size):
            raise ValueError(f"weight {name}: checkpoint shape {tuple(loaded.shape)} does not "
                             f"match the model's {(rows, layer.input_size)}")
        self.dtype = loaded.dtype
        self.pending[shard_id] = loaded

    def load_dense(self, layer: Linear, weight: torch.Tensor) -> None:
        self.dtype = weight.dtype
        for shard_id in (list(layer.shard_offsets) or [None]):
            if shard_id is None:
                self.pending[None] = weight
            else:
                offset, size = layer.shard_offsets[shard_id]
                self.pending[shard_id] = weight[offset:offset + size]

    def finish(self, layer: Linear) -> None:
        """Group consecutive shards of one type into segments, each on its kernel."""
        pending, self.pending = self.pending, {}
        order = [None] if None in pending else list(layer.shard_offsets)
        groups: list[tuple[int, list[torch.Tensor], str]] = []
        offset = 0
        for shard_id in order:
            t = pending[shard_id]
            qtype = getattr(t, "quant_type", None)
            kind = _segment_kind(qtype, t.shape[0], layer.input_size, layer.device, self.dtype)
            if groups and groups[-1][2] == kind and \
                    getattr(groups[-1][1][0], "quant_type", None) == qtype:
                groups[-1][1].append(t)
            else:
                groups.append((offset, [t], kind))
            offset += t.shape[0]
        self.segments = [_make_segment(off, parts, kind, layer.input_size, layer.device,
                                       self.dtype) for off, parts, kind in groups]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.dense_beside is not None and x.shape[0] > self.beside_above:
            y = F.linear(x, self.dense_beside)
        elif len(self.segments) == 1:
            y = self.segments[0].run(x)
        else:
            y = torch.empty(x.shape[0], layer.output_size, dtype=x.dtype, device=x.device)
            for seg in self.segments:
                seg.run(x, y[:, seg.offset:seg.offset + seg.rows])
        return y if layer.bias is None else y + layer.bias

    def describe(self, layer: Linear) -> str | None:
        quantized = [s for s in self.segments if s.quant_type is not None]
        if not quantized:
            return None
        types = "+".join(dict.fromkeys(s.quant_type for s in quantized))  # type: ignore[misc]
        kinds = {s.kind for s in quantized}
        hows = []
        for kind in ("gguf", "cpu_blocks", "int4", "cpu_quant", "dense"):
            if kind not in kinds:
                continue
            if kind == "gguf":
                hows.append("kept in GGUF blocks (Triton dequant-GEMV; prefill "
                            "dequantizes a transient copy for cuBLAS)")
            elif kind == "cpu_blocks":
                hows.append(self._beside(f"kept in GGUF blocks (CPU C kernel, "
                                         f"{dtype_name(self.dtype)})"))
            elif kind == "int4":
                hows.append(self._beside(f"run 4-bit (CPU int4 matmul, "
                                         f"{dtype_name(self.dtype)})"))
            elif kind == "cpu_quant":
                hows.append(f"kept in GGUF blocks (CPU kernel, {dtype_name(self.dtype)})")
            else:
                hows.append(f"dequantized to {dtype_name(self.dtype)}")
        return f"{types} layer(s) " + " and ".join(hows)


    def _beside(self, how: str) -> str:
        """``how``, and where a dense weight serves the larger batches, from when."""
        if self.dense_beside is None:
            return how
        return (f"{how} up to {self.beside_above} tokens, dense "
                f"{dtype_name(self.dense_beside.dtype)} above")


class GGUFConfig(QuantizationConfig):
    """Every linear layer of a GGUF model takes ``GGUFLinearMethod``: the tensor types
    are the file's, read shard by shard as they load."""

    name = "gguf"

    def linear_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        return GGUFLinearMethod()


def tied_head(embed: torch.nn.Module, tensor: QuantizedTensor) -> Linear | None:
    """A CPU output head for a tied embedding that came block-quantized: in a bfloat16
    model a 4-bit copy of a Q4_0 / Q4_1 / Q8_0 table (Q8_0 in two passes) for up to
    ``INT4_MAX_TOKENS_BESIDE_DENSE`` tokens, else the blocks through the C kernel
    (``cpu_gguf``) for up to ``cpu_gguf.MAX_KERNEL_ROWS``; the dense embedding (which serves
    the lookups) takes larger batches. None where neither applies (on CUDA a quantized
    embedding is its own head: ``head_logits``)."""
    from vllmpy.layers.linear import Linear
    from vllmpy.ops import cpu_gguf
    from vllmpy.ops.cpu_int4 import int4_supported, pack_int4

    vocab, hidden = tuple(tensor.shape)
    weight = getattr(embed, "weight", None)
    if weight is None:
        return None
    if int4_supported(tensor.quant_type, vocab, weight.device, weight.dtype, two_pass=True):
        segment = Segment(0, vocab, "int4", tensor.quant_type,
                          pack_int4(tensor.blocks, tensor.quant_type, hidden, weight.dtype))
        above = INT4_MAX_TOKENS_BESIDE_DENSE
    elif cpu_gguf.supported(tensor.quant_type, hidden, weight.device):
        segment = Segment(0, vocab, "cpu_blocks", tensor.quant_type,
                          cpu_gguf.make(tensor.blocks, tensor.quant_type, vocab, hidden))
        above = cpu_gguf.MAX_KERNEL_ROWS
    else:
        return None
    with torch.device("meta"):
        head = Linear(hidden, vocab)
    method = GGUFLinearMethod()
    head.set_method(method)
    method.dtype = weight.dtype
    method.segments = [segment]
    method.dense_beside = weight
    method.beside_above = above
    return head
