"""FP8 (e4m3) W8A8 linear layers: ``quant_method: fp8`` checkpoints (per-tensor scales, or
128 x 128 block scales as DeepSeek-V3 and Qwen3-FP8 store them), and the fp8 schemes of
compressed-tensors and ModelOpt, which build on ``Fp8LinearMethod``.

Layouts (every scale multiplies the stored value):

* per-tensor (``quant_method: fp8`` without ``weight_block_size``, ModelOpt FP8):
  ``weight`` fp8 [N, K] and a one-element ``weight_scale`` per checkpoint matrix;
  ``input_scale`` (one element) with static activations;
* per-channel (compressed-tensors ``float-quantized``, strategy channel): ``weight_scale``
  [N, 1]; activations dynamic per token;
* block (``weight_block_size: [bn, bk]``): ``weight_scale_inv`` fp32 [ceil(N / bn),
  ceil(K / bk)]; activations dynamic per 1 x bk group.

Per-tensor and per-channel scales are both held as one [N, 1] column (a packed layer's
shards keep their own scales, with no requantization); static input scales of a packed
layer's shards are merged to their maximum, as vLLM does. On CUDA (compute capability
8.9 or newer) the kernels of ``vllmpy.ops.fp8_gemm`` run them; on the CPU the weights are
dequantized to the model's dtype at load, and the start-up line says so.

MoE experts: ``vllmpy.layers.quantization.fp8_moe``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vllmpy.layers.quantization.base import (
    LinearMethod,
    MoEMethod,
    QuantizationConfig,
    QuantizationError,
    copy_checked,
    dtype_name,
    ignored,
    new_param,
    shard_view,
)
from vllmpy.layers.quantization.dense import SKINNY_MAX_OUTPUT, DenseMethod

if TYPE_CHECKING:
    from vllmpy.layers.linear import Linear
    from vllmpy.layers.moe import FusedMoE

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_CAPABILITY = (8, 9)  # fp8 tensor-core operands


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes, one-element fp32 scale) of a dense matrix: scale = amax / 448."""
    scale = (w.float().abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(1)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_block(w: torch.Tensor, block: tuple[int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes [N, K], fp32 scales [ceil(N / bn), ceil(K / bk)]) of a dense matrix."""
    bn, bk = block
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(gn, bn, gk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [gn, gk]
    codes = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return codes.view(gn * bn, gk * bk)[:n, :k].to(FP8), scale


def dequantize_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype) -> torch.Tensor:
    bn, bk = block
    n, k = weight.shape
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * full).to(dtype)


class Fp8LinearMethod(LinearMethod):
    """One layer's fp8 weight (see the module docstring for the three layouts).

    ``scheme``: "tensor", "channel" or "block"; ``activations``: "dynamic" (per token, or
    per group for blocks) or "static" (a checkpoint ``input_scale``); ``online``: the
    checkpoint is dense and the weight is quantized per shard as it loads."""

    def __init__(self, scheme: str, activations: str = "dynamic",
                 block: tuple[int, int] | None = None, online: bool = False,
                 scale_name: str = "weight_scale",
                 model_dtype: torch.dtype = torch.bfloat16) -> None:
        self.scheme = scheme
        self.model_dtype = model_dtype
        self.static = activations == "static"
        self.block = block
        self.online = online
        self.scale_name = "weight_scale_inv" if scheme == "block" else scale_name
        self.on_cuda = False
        self.cublas_blocks: str | None = None  # fp8_gemm.block_scaled_mm's answer
        self.dense: torch.Tensor | None = None  # the CPU's dequantized weight
        self.input_scale: torch.Tensor | None = None  # merged static scale [1]
        self.name = {"tensor": "fp8 per-tensor", "channel": "fp8 per-channel",
                     "block": f"fp8 block {block[0]}x{block[1]}" if block else "fp8"}[scheme]

    def create_weights(self, layer: Linear) -> None:
        n, k = layer.output_size, layer.input_size
        new_param(layer, "weight", (n, k), FP8)
        if self.scheme == "block":
            assert self.block is not None
            bn, bk = self.block
            new_param(layer, self.scale_name, (-(-n // bn), -(-k // bk)), torch.float32,
                      pack=bn)
        else:  # a per-tensor scale fills its shard's rows of the column
            new_param(layer, "weight_scale", (n, 1), torch.float32)
        if self.static:
            new_param(layer, "input_scale", (len(layer.shard_offsets) or 1,), torch.float32,
                      per_shard=True)

    def checkpoint_names(self, layer: Linear) -> tuple[str, ...]:
        if self.online:
            return ("weight",)
        names = ("weight", self.scale_name)
        return names + ("input_scale",) if self.static else names

    def load(self, layer: Linear, suffix: str, loaded: torch.Tensor, shard_id: Any,
             name: str) -> None:
        if suffix == "weight" and self.online:
            self._quantize_into(layer, loaded, shard_id, name)
            return
        dst = shard_view(layer, getattr(layer, suffix), shard_id, name)
        if suffix == "weight" and loaded.dtype != FP8:
            raise QuantizationError(f"weight {name}: an {self.name} checkpoint stores "
                                    f"float8_e4m3fn weights; this one is {loaded.dtype}")
        if suffix in ("weight_scale", "input_scale") and loaded.numel() == 1:
            with torch.no_grad():
                dst.fill_(float(loaded.reshape(()).float()))
            return
        copy_checked(dst, loaded.to(dst.dtype) if suffix != "weight" else loaded, name)

    def _quantize_into(self, layer: Linear, dense: torch.Tensor, shard_id: Any,
                       name: str) -> None:
        dense = dense.dense(torch.float32) if hasattr(dense, "dense") else dense
        dst = shard_view(layer, layer.weight, shard_id, name)
        if tuple(dst.shape) != tuple(dense.shape):
            copy_checked(dst, dense, name)  # names the mismatch
        codes, scale = quantize_per_tensor(dense.to(dst.device))
        with torch.no_grad():
            dst.copy_(codes)
            shard_view(layer, layer.weight_scale, shard_id, name).fill_(float(scale))

    def load_dense(self, layer: Linear, weight: torch.Tensor) -> None:
        with torch.no_grad():
            if self.scheme == "block":
                assert self.block is not None
                codes, scale = quantize_per_block(weight, self.block)
                layer.weight.copy_(codes)
                getattr(layer, self.scale_name).copy_(scale)
            else:
                for shard_id in (list(layer.shard_offsets) or [None]):
                    part = weight if shard_id is None else weight[
                        slice(*_rows(layer.shard_offsets[shard_id]))]
                    self._quantize_into(layer, part, shard_id, "weight")
            if self.static:
                layer.input_scale.fill_(1.0 / FP8_MAX * 4)  # activations of |x| <= 4

    def finish(self, layer: Linear) -> None:
        if self.static:
            self.input_scale = layer.input_scale.detach().amax().reshape(1).contiguous()
        if not self.on_cuda:  # the CPU runs the dequantized weight
            dtype = self.model_dtype
            if self.scheme == "block":
                assert self.block is not None
                self.dense = dequantize_block(layer.weight, getattr(layer, self.scale_name),
                                              self.block, dtype)
            else:
                self.dense = (layer.weight.float() * layer.weight_scale).to(dtype)
            for name in layer.method_params:  # the fp8 tensors are not needed any more
                setattr(layer, name, None)

    def bind(self, layer: Linear, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        if self.on_cuda and layer.output_size <= SKINNY_MAX_OUTPUT:
            from vllmpy.ops import skinny_gemm

            self.skinny = skinny_gemm
        if self.on_cuda and self.block is not None:
            from vllmpy.ops.fp8_gemm import CUBLAS_BLOCK, block_scaled_mm, native_fp8

            if self.block == CUBLAS_BLOCK and native_fp8(device):  # tried once, eagerly
                self.cublas_blocks = block_scaled_mm(device)

    def stream_scale(self, layer: Linear) -> Any:
        from vllmpy.ops.skinny_gemm import WeightScale

        return WeightScale(getattr(layer, self.scale_name), self.block)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return F.linear(x, self.dense.to(x.dtype), layer.bias)
        if layer.streams_one_row(x):  # a decode row: weight-only, see describe()
            return self.skinny.skinny_gemm(x, layer.weight, layer.bias, self.stream_scale(layer))
        from vllmpy.ops import fp8_gemm

        if self.scheme == "block":
            assert self.block is not None
            return fp8_gemm.fp8_block_linear(x, layer.weight, getattr(layer, self.scale_name),
                                             layer.bias, self.block)
        return fp8_gemm.fp8_scaled_linear(x, layer.weight, layer.weight_scale,
                                          self.input_scale, layer.bias, dynamic="per_token")

    def describe(self, layer: Linear) -> str:
        acts = "static per-tensor" if self.static else (
            "dynamic per-group" if self.scheme == "block" else "dynamic per-token")
        how = (f"dequantized to {dtype_name(self.dense.dtype)} on the CPU"
               if self.dense is not None else f"W8A8, {acts} activations (Triton / cuBLAS)")
        if self.cublas_blocks is not None:
            how += "; more than 16 rows through cuBLAS's block-scaled GEMM"
        if self.skinny is not None:
            how += "; one-row steps stream the fp8 weight with unquantized activations"
        origin = " (quantized at load)" if self.online else ""
        return f"{self.name}{origin} layer(s) {how}"


def _rows(offset_size: tuple[int, int]) -> tuple[int, int]:
    offset, size = offset_size
    return offset, offset + size


class Fp8HeadMethod(LinearMethod):
    """An output head in an fp8 checkpoint: dense (BF16, the usual case), or F8_E4M3 with a
    per-channel or per-tensor ``weight_scale`` — decided by the stored dtype."""

    name = "fp8 lm_head"

    def __init__(self, model_dtype: torch.dtype = torch.bfloat16) -> None:
        self.inner: LinearMethod | None = None
        self.model_dtype = model_dtype
        self.early_scale: tuple[torch.Tensor, str] | None = None  # a scale before its weight

    def create_weights(self, layer: Linear) -> None:
        """Nothing until the weight shows its dtype."""

    def checkpoint_names(self, layer: Linear) -> tuple[str, ...]:
        return ("weight",) if self.inner is None else self.inner.checkpoint_names(layer)

    def optional_names(self, layer: Linear) -> tuple[str, ...]:
        return ("weight_scale",)

    def _become(self, layer: Linear, method: LinearMethod) -> None:
        """Create the chosen method's parameters now, on the layer's device (the model is
        materialized already), the dense ones in the model's dtype."""
        with torch.device(layer.device):
            method.create_weights(layer)
        for name in layer.method_params:
            param = getattr(layer, name)
            if not getattr(param, "keep_dtype", False):
                param.data = param.data.to(self.model_dtype)
        method.bind(layer, layer.device)
        self.inner = method

    def load(self, layer: Linear, suffix: str, loaded: torch.Tensor, shard_id: Any,
             name: str) -> None:
        if self.inner is None and suffix == "weight_scale":
            self.early_scale = (loaded, name)
            return
        if self.inner is None:
            self._become(layer, Fp8LinearMethod("channel", model_dtype=self.model_dtype)
                         if loaded.dtype == FP8 else DenseMethod())
            self.inner.load(layer, suffix, loaded, shard_id, name)  # type: ignore[union-attr]
            if self.early_scale is not None:
                scale, scale_name = self.early_scale
                self.load(layer, "weight_scale", scale, shard_id, scale_name)
            return
        if suffix == "weight_scale" and isinstance(self.inner, DenseMethod):
            raise QuantizationError(f"weight {name}: a scale for an unquantized lm_head")
        self.inner.load(layer, suffix, loaded, shard_id, name)

    def load_dense(self, layer: Linear, weight: torch.Tensor) -> None:
        self._become(layer, DenseMethod())
        assert self.inner is not None
        self.inner.load_dense(layer, weight)

    def finish(self, layer: Linear) -> None:
        assert self.inner is not None
        self.inner.finish(layer)

    def bind(self, layer: Linear, device: torch.device) -> None:
        if self.inner is not None:
            self.inner.bind(layer, device)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        assert self.inner is not None
        return self.inner.apply(layer, x)

    @property
    def skinny(self) -> Any:  # type: ignore[override]
        return None if self.inner is None else self.inner.skinny

    def stream_scale(self, layer: Linear) -> Any:
        assert self.inner is not None
        return self.inner.stream_scale(layer)

    def describe(self, layer: Linear) -> str | None:
        return None if self.inner is None else self.inner.describe(layer)


def check_fp8_device(device: torch.device, where: str) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise QuantizationError(
            f"{where}: fp8 weights need a GPU of compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer; this one is {major}.{minor}")


class Fp8Config(QuantizationConfig):
    """``quant_method: fp8`` (vLLM's and transformers' serialization)."""

    name = "fp8"
    KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "ignored_layers",
            "modules_to_not_convert", "kv_cache_scheme", "kv_cache_quant_algo"}

    def __init__(self, activations: str = "dynamic", block: tuple[int, int] | None = None,
                 ignore: list[str] | None = None, online: bool = False) -> None:
        super().__init__()
        self.activations = activations
        self.block = block
        self.ignore = ignore or []
        self.online = online

    @classmethod
    def from_checkpoint(cls, section: dict, where: str) -> Fp8Config:
        unknown = sorted(set(section) - cls.KEYS)
        if unknown:
            raise QuantizationError(f"{where}: key {unknown[0]!r} of quant_method 'fp8' is "
                                    "not supported")
        fmt = section.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationError(f"{where}: fmt={fmt!r} is not supported (only 'e4m3')")
        acts = section.get("activation_scheme", "dynamic")
        if acts not in ("dynamic", "static"):
            raise QuantizationError(f"{where}: activation_scheme={acts!r} is not supported; "
                                    "supported: ['dynamic', 'static']")
        block = section.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, list) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise QuantizationError(f"{where}: weight_block_size={block!r} is not two "
                                        "positive integers")
            if acts != "dynamic":
                raise QuantizationError(f"{where}: activation_scheme={acts!r} with "
                                        "weight_block_size: block-scaled fp8 takes dynamic "
                                        "activations only")
            block = (block[0], block[1])
        ignore = section.get("ignored_layers") or section.get("modules_to_not_convert")
        return cls(acts, block, ignore)

    @classmethod
    def online(cls) -> Fp8Config:
        """``--quantization fp8`` on a dense checkpoint: per-tensor fp8, dynamic activations."""
        return cls("dynamic", None, None, online=True)

    def check_device(self, device: torch.device, dtype: torch.dtype) -> None:
        check_fp8_device(device, "quant_method 'fp8'")

    def router_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        """FP8 checkpoints keep MoE routers in the model's dtype (vLLM never quantizes
        them), whether or not the ignore list names them."""
        return DenseMethod()

    def moe_method(self, layer_name: str, layer: FusedMoE) -> MoEMethod | None:
        if ignored(layer_name, self.ignore):
            return None
        if self.activations == "static":
            raise QuantizationError(
                f"quant_method 'fp8': activation_scheme 'static' on the MoE experts of "
                f"{layer_name}: fp8 experts run with activations in the model's dtype and "
                "static activation scales are not supported for them")
        if self.block is not None and self.block[1] % 16:
            raise QuantizationError(
                f"quant_method 'fp8': weight_block_size {list(self.block)} on the MoE "
                f"experts of {layer_name}: the expert kernels need a block width along K "
                "that is a multiple of 16")
        from vllmpy.layers.quantization.fp8_moe import Fp8MoEMethod

        return Fp8MoEMethod(self.block, online=self.online, model_dtype=self.model_dtype)

    def linear_method(self, layer_name: str, layer: Linear) -> LinearMethod:
        if layer_name == "lm_head" or layer_name.endswith(".lm_head"):
            return DenseMethod() if self.online else Fp8HeadMethod(self.model_dtype)
        if ignored(layer_name, self.ignore):
            return DenseMethod()
        if self.block is not None:
            return Fp8LinearMethod("block", "dynamic", self.block,
                                   model_dtype=self.model_dtype)
        return Fp8LinearMethod("tensor", self.activations, online=self.online,
                               model_dtype=self.model_dtype)
