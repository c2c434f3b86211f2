"""The attention layer models call: binds one layer's KV cache to a backend, and holds the
layer's KV-cache scales (``k_scale``, ``v_scale``) that an fp8 cache is quantized with."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from vllmpy.attention.backend import FP8_KV_DTYPE, AttentionBackend
from vllmpy.attention.cpu_backend import CpuAttentionBackend
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import log


class Attention(nn.Module):
    """Paged attention for one layer. ``kv_cache`` is bound by the model runner after the
    pool is allocated; ``backend`` is the CPU one until the runner swaps in a device's own.

    ``k_scale`` and ``v_scale`` are the per-layer scales of an fp8 cache (stored = value /
    scale); they come from the checkpoint (see ``KVScaleLoader``) and are 1.0 otherwise.
    Caches of other dtypes ignore them.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend = CpuAttentionBackend(
            num_heads, num_kv_heads, head_dim, scale)
        self.kv_cache: torch.Tensor | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.loaded_scales: set[str] = set()  # "k_scale" / "v_scale" read from the checkpoint

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, kv_stored: bool = False) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim], k/v: [num_tokens, num_kv_heads * head_dim].
        ``kv_stored``: the caller has already written k and v at ``meta.slot_mapping``."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer used before its KV cache was bound")
        n = q.shape[0]
        out = self.backend.forward(
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
            self.kv_cache, meta, self.k_scale, self.v_scale, kv_stored)
        return out.reshape(n, self.num_heads * self.head_dim)

    def decode_from_qkv(self, qkv: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, meta: AttentionMetadata,
                        q_norm_weight: torch.Tensor | None = None,
                        k_norm_weight: torch.Tensor | None = None,
                        eps: float = 0.0) -> torch.Tensor | None:
        """The attention output [num_tokens, num_heads * head_dim] of a decode step taken
        straight from the packed qkv projection [num_tokens, q + k + v], when the backend
        runs that in one pass: rotary at ``positions`` from ``cos_sin_cache`` (after a
        per-head RMSNorm of q and k with the given weights), the new keys and values
        stored, attention. None when it does not (not a pure decode, an fp8 cache, another
        backend): the caller then runs rotary and ``forward``."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer used before its KV cache was bound")
        out = self.backend.decode_from_qkv(qkv, positions, cos_sin_cache, self.kv_cache, meta,
                                           q_norm_weight, k_norm_weight, eps)
        return None if out is None else out.reshape(qkv.shape[0], self.num_heads * self.head_dim)


# A layer's KV-cache scales as checkpoints name them, relative to the decoder layer's
# attention module: ``self_attn.k_scale`` (compressed-tensors), ``self_attn.k_proj.k_scale``
# (ModelOpt) and vLLM's own ``self_attn.attn.k_scale``; likewise for ``v_scale``.
KV_SCALE_NAMES = ("k_scale", "v_scale")


class KVScaleLoader:
    """Takes the KV-cache scales out of a checkpoint's tensors and into the model's
    ``Attention`` layers; every other tensor passes through to the model's loader.

    Usage in ``load_weights``: ``loaded = load(model, scales.filter(weights), ...)``, then
    ``loaded | scales.loaded``. A scale that names no attention layer, or that is not one
    positive finite number, is refused naming the tensor.
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
        self.loaded: set[str] = set()  # "<attention module>.k_scale" names

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            prefix, _, kind = name.rpartition(".")
            if kind not in KV_SCALE_NAMES:
                yield name, tensor
                continue
            self._load(name, kind, prefix, tensor)

    def _load(self, name: str, kind: str, prefix: str, tensor: torch.Tensor) -> None:
        for holder in (f".{kind[0]}_proj", ".attn"):
            if prefix.endswith(holder):
                prefix = prefix.removesuffix(holder)
                break
        layer_name = f"{prefix}.attn"
        layer = self.layers.get(layer_name)
        if layer is None:
            raise ValueError(f"checkpoint tensor {name!r} is a KV-cache scale but names no "
                             f"attention layer of the model (expected '...self_attn.{kind}', "
                             f"'...self_attn.{kind[0]}_proj.{kind}' or "
                             f"'...self_attn.attn.{kind}')")
        value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
        if not (math.isfinite(value) and value > 0):
            got = f"value {value}" if tensor.numel() == 1 else f"shape {tuple(tensor.shape)}"
            raise ValueError(f"checkpoint tensor {name!r} must hold one positive finite "
                             f"KV-cache scale (per layer); got {got}")
        setattr(layer, kind, value)
        layer.loaded_scales.add(kind)
        self.loaded.add(f"{layer_name}.{kind}")


def report_kv_scales(layers: list[Attention], kv_cache_dtype: torch.dtype) -> None:
    """With an fp8 cache, say on stderr which layers serve on scale 1.0 because the
    checkpoint shipped no k_scale/v_scale for them."""
    if kv_cache_dtype != FP8_KV_DTYPE or not layers:
        return
    missing = [layer for layer in layers if layer.loaded_scales != set(KV_SCALE_NAMES)]
    if not missing:
        return
    if len(missing) == len(layers):
        which = "the checkpoint ships no k_scale/v_scale tensors; every layer serves"
    else:
        which = (f"the checkpoint ships no k_scale/v_scale for {len(missing)} of "
                 f"{len(layers)} attention layers; those serve")
    log(f"fp8 KV cache: {which} on scale 1.0 (keys and values past +-448 are clamped)")
