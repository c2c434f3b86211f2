"""Linear layers, including the packed forms that fuse several checkpoint matrices.

Each packed layer owns one weight and knows where every checkpoint shard lands in it;
its ``weight_loader(param, loaded_weight, shard_id)`` copies one shard into place.

A checkpoint tensor may also arrive block-quantized (a ``QuantizedTensor`` from a GGUF
file). The rule for it is one line (``int4_supported``): a Q4_0 / Q4_1 weight of a
bfloat16 model on the CPU is kept 4-bit and runs PyTorch's CPU 4-bit matmul; anything
else is dequantized into the dense weight, exactly as the dense path always did. A layer
that keeps its weight 4-bit drops the dense ``weight`` parameter (it is ``None``). The one
exception is a tied lm_head (``tie_quantized_lm_head``): it keeps the embedding's dense
weight beside a 4-bit copy, and Q8_0 qualifies there too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.layers.custom_op import CustomOp
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.quantized import (
    Int4Weight,
    QuantizedTensor,
    int4_linear,
    int4_supported,
    pack_int4,
)

# A layer holding both a dense weight and a 4-bit copy (a tied lm_head, see
# ``tie_quantized_lm_head``) runs 4-bit for up to this many tokens, dense above: the 4-bit
# matmul reads fewer bytes but computes slower.
INT4_MAX_TOKENS_BESIDE_DENSE = 4


def _check_shape(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"weight {name}: checkpoint shape {tuple(src.shape)} does not match the "
            f"model's {tuple(dst.shape)}")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    """Copy ``loaded`` into ``param``; a quantized tensor is dequantized to its dtype."""
    _check_shape(name, param, loaded)
    if isinstance(loaded, QuantizedTensor):
        loaded = loaded.dense(param.dtype)
    with torch.no_grad():
        param.copy_(loaded)


class Linear(CustomOp):
    """y = x W^T (+ b), with W of shape [output_size, input_size].

    ``int4`` holds the weight when it runs 4-bit (then ``weight`` is None);
    ``checkpoint_quant`` names the GGUF type the weight came in, if it came quantized.
    """

    weight: nn.Parameter | None

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(output_size), requires_grad=False)
                     if bias else None)
        self.int4: Int4Weight | None = None
        self.checkpoint_quant: str | None = None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        int4 = self.int4
        if int4 is not None and (x.shape[0] <= INT4_MAX_TOKENS_BESIDE_DENSE
                                 or self.weight is None):
            y = int4_linear(x, int4)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]

    def bind_device(self, device: torch.device) -> None:
        super().bind_device(device)
        if self.on_cuda:
            from vllmpy.ops import skinny_gemm

            self._skinny = skinny_gemm

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        if self.streams_one_row(x):
            return self._skinny.skinny_gemm(x, self.weight, self.bias)  # type: ignore[arg-type]
        return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]

    def streams_one_row(self, x: torch.Tensor) -> bool:
        """Whether x goes through the weight-streaming kernel (``vllmpy.ops.skinny_gemm``):
        one row on CUDA (a batch-1 decode), where it beats cuBLAS on the decoder's
        matrices. On a vocabulary-wide lm_head cuBLAS is faster."""
        return (self.on_cuda and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1
                and self.output_size <= 32768 and self.weight is not None
                and self.int4 is None)

    def _dense(self, name: str) -> nn.Parameter:
        if self.weight is None:
            raise ValueError(f"weight {name}: loaded twice (the layer already holds a "
                             "4-bit weight)")
        return self.weight

    def _use_int4(self, quant_type: str, rows: int) -> bool:
        weight = self._dense("")
        return int4_supported(quant_type, rows, weight.device, weight.dtype)

    def _set_int4(self, qt: QuantizedTensor) -> None:
        dtype = self._dense("").dtype
        self.int4 = pack_int4(qt, dtype)
        self.weight = None  # the dense copy is not needed any more

    def load_weight(self, loaded: torch.Tensor, name: str = "") -> None:
        """Load the whole weight: dense, or quantized (kept 4-bit where the rule allows)."""
        weight = self._dense(name)
        if isinstance(loaded, QuantizedTensor):
            _check_shape(name, weight, loaded)
            self.checkpoint_quant = loaded.quant_type
            if self._use_int4(loaded.quant_type, loaded.shape[0]):
                self._set_int4(loaded)
                return
        default_weight_loader(weight, loaded, name)


def rms_norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor,
                    residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(x + residual)), x + residual)``; without a residual
    ``(linear(norm(x)), x)``. A row the linear layer streams takes one launch for both
    (``rms_norm_gemm``), with the same values as the two layers one after the other."""
    if (type(norm) is RMSNorm and linear.streams_one_row(x) and norm.weight.dtype == x.dtype
            and (residual is None or residual.stride(-1) == 1)):
        return linear._skinny.rms_norm_gemm(x, residual, norm.weight, norm.eps, linear.weight,
                                            linear.bias)  # type: ignore[arg-type]
    if residual is None:
        return linear(norm(x)), x
    normed, residual = norm(x, residual)
    return linear(normed), residual


class PackedLinear(Linear):
    """Several checkpoint matrices stacked along the output dimension.

    ``shards`` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its output size; the order of
    the mapping is the order of the rows. Quantized shards that may run 4-bit wait until
    every shard is in; they are packed together if all came in the same 4-bit type, and
    dequantized into place otherwise.
    """

    def __init__(self, input_size: int, shards: dict[str | int, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(shards.values()), bias)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        self._pending: dict[str | int, QuantizedTensor] = {}  # quantized shards held back
        self._received: set[str | int] = set()

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: str | int, name: str = "") -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"weight {name}: unknown shard {shard_id!r}")
        offset, size = self.shard_offsets[shard_id]
        dst = param.narrow(0, offset, size)
        _check_shape(name, dst, loaded)
        if param is self.bias:
            default_weight_loader(dst, loaded, name)
            return
        self._dense(name)  # refuses a shard that comes after the layer went 4-bit
        self._received.add(shard_id)
        if isinstance(loaded, QuantizedTensor):
            self.checkpoint_quant = loaded.quant_type
            if self._use_int4(loaded.quant_type, self.output_size):
                self._pending[shard_id] = loaded
            else:
                default_weight_loader(dst, loaded, name)
        else:
            default_weight_loader(dst, loaded, name)
        if self._received == set(self.shard_offsets):
            self._finish(param)

    def _finish(self, param: torch.Tensor) -> None:
        pending, self._pending = self._pending, {}
        types = {qt.quant_type for qt in pending.values()}
        if len(pending) == len(self.shard_offsets) and len(types) == 1:
            blocks = torch.cat([pending[s].blocks for s in self.shard_offsets])
            self._set_int4(next(iter(pending.values())).with_blocks(blocks))
            return
        for shard_id, qt in pending.items():  # mixed with dense or other types
            offset, size = self.shard_offsets[shard_id]
            default_weight_loader(param.narrow(0, offset, size), qt)


def tie_quantized_lm_head(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
    embedding: str = "model.embed_tokens",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass a tied model's checkpoint through; if its embedding comes quantized in a form
    the 4-bit matmul runs (Q8_0 in two passes), give the model an ``lm_head`` that shares
    the embedding's dense weight (for large batches) and holds a 4-bit copy (for up to
    ``INT4_MAX_TOKENS_BESIDE_DENSE`` tokens)."""
    embed = model.get_submodule(embedding)
    weight = embed.weight
    assert isinstance(embed, nn.Embedding) and isinstance(weight, nn.Parameter)
    for name, tensor in weights:
        if name == f"{embedding}.weight" and isinstance(tensor, QuantizedTensor) and \
                int4_supported(tensor.quant_type, tensor.shape[0], weight.device,
                               weight.dtype, two_pass=True):
            with torch.device("meta"):
                head = Linear(embed.embedding_dim, embed.num_embeddings)
            head.weight = weight  # the same parameter: loaded with the embedding
            head.int4 = pack_int4(tensor, weight.dtype)
            head.checkpoint_quant = tensor.quant_type
            model.lm_head = head
        yield name, tensor


def describe_quantized_layers(model: nn.Module) -> str | None:
    """One line on how the linear layers that came quantized run, or None if none did."""
    counts: Counter[tuple[str, str]] = Counter()
    for module in model.modules():
        if isinstance(module, Linear) and module.checkpoint_quant is not None:
            if module.int4 is not None:
                how = f"run 4-bit (CPU int4 matmul, {_dtype_name(module.int4.dtype)})"
                if module.weight is not None:
                    how += (f" up to {INT4_MAX_TOKENS_BESIDE_DENSE} tokens, dense "
                            f"{_dtype_name(module.weight.dtype)} above")
            else:
                how = f"dequantized to {_dtype_name(module.weight)}"
            counts[(module.checkpoint_quant, how)] += 1
    if not counts:
        return None
    parts = [f"{n} {qtype} layer(s) {how}" for (qtype, how), n in sorted(counts.items())]
    return "quantized linear weights: " + "; ".join(parts)


def _dtype_name(t: torch.Tensor | torch.dtype | None) -> str:
    dtype = t.dtype if isinstance(t, torch.Tensor) else t
    return "?" if dtype is None else str(dtype).removeprefix("torch.")
