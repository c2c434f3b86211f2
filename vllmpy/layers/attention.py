"""The attention layer models call: binds one layer's KV cache to a backend, and holds the
layer's KV-cache scales (``k_scale``, ``v_scale``) that an fp8 cache is quantized with."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from vllmpy.attention.backend import FP8_KV_DTYPE, AttentionBackend
from vllmpy.attention.cpu_backend import CpuAttentionBackend
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import log
from vllmpy.core.cache_spec import PagedKVSpec
from vllmpy.layers.linear import Linear, PackedLinear
from vllmpy.layers.norm import RMSNorm


class Attention(nn.Module):
    """Paged attention for one layer. ``kv_cache`` is bound by the model runner after the
    pool is allocated (``bind``), together with the device's backend; until then the
    backend is the CPU one. ``sliding_window`` and ``logit_softcap`` are the layer's
    attention features (see ``AttentionBackend``). ``k_scale`` and ``v_scale`` are the
    per-layer scales of an fp8 cache (stored = value / scale); they come from the
    checkpoint (see ``KVScaleLoader``) and are 1.0 otherwise. Caches of other dtypes
    ignore them.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None,
                 logit_softcap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.backend: AttentionBackend = self._backend(CpuAttentionBackend)
        self.kv_cache: torch.Tensor | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.loaded_scales: set[str] = set()  # "k_scale" / "v_scale" read from the checkpoint

    def cache_spec(self) -> PagedKVSpec:
        """What the layer caches: paged keys and values (``vllmpy.core.cache_spec``)."""
        return PagedKVSpec(self.num_kv_heads, self.head_dim, self.sliding_window)

    def _backend(self, cls: type[AttentionBackend], **extra: Any) -> AttentionBackend:
        return cls(self.num_heads, self.num_kv_heads, self.head_dim,  # type: ignore[call-arg]
                   self.scale, sliding_window=self.sliding_window,
                   logit_softcap=self.logit_softcap, **extra)

    def bind(self, kv_cache: torch.Tensor, **backend_args: Any) -> None:
        """Give the layer its cache and the backend of the cache's device (the Triton one
        on CUDA; ``backend_args`` go to it, e.g. a fixed ``num_splits``)."""
        self.kv_cache = kv_cache
        if kv_cache.is_cuda:
            from vllmpy.attention.triton_backend import TritonAttentionBackend

            self.backend = self._backend(TritonAttentionBackend, **backend_args)
        elif not isinstance(self.backend, CpuAttentionBackend):
            self.backend = self._backend(CpuAttentionBackend)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, kv_stored: bool = False,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim], k/v: [num_tokens, num_kv_heads * head_dim].
        ``kv_stored``: the caller has already written k and v at ``meta.slot_mapping``.
        ``sinks``: the layer's per-head sink logits [num_heads] (see ``AttentionBackend``)."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer used before its KV cache was bound")
        n = q.shape[0]
        out = self.backend.forward(
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
            self.kv_cache, meta, self.k_scale, self.v_scale, kv_stored, sinks=sinks)
        return out.reshape(n, self.num_heads * self.head_dim)


class SelfAttention(nn.Module):
    """The attention block of a decoder layer, with Hugging Face's parameter names:
    ``qkv_proj`` (q, k and v packed: checkpoint ``q_proj``/``k_proj``/``v_proj`` or one
    fused ``qkv_proj``), optional ``q_norm``/``k_norm``, ``rotary_emb`` (None: no rotary,
    as for learned absolute positions or NoPE layers), the paged ``attn`` and ``o_proj``.

    ``qk_norm`` builds the q/k norms from a width: per head (``qk_norm_per_head``, width
    head_dim: Qwen3, Gemma-3) or over the whole projection (OLMo-2). The backend decides
    what runs fused (``AttentionBackend.fused_qkv``); the model never does.

    ``sinks=True`` gives the block GPT-OSS's ``sinks`` [num_heads], a learned logit per
    query head in every softmax denominator (kept in float32; None without).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 *, rotary: nn.Module | None, scale: float | None = None,
                 qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: Callable[[int], nn.Module] | None = None,
                 qk_norm_per_head: bool = True, sliding_window: int | None = None,
                 logit_softcap: float | None = None, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = PackedLinear(
            hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, bias=o_bias)
        self.qk_norm_per_head = qk_norm_per_head
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if qk_norm is not None:
            self.q_norm = qk_norm(head_dim if qk_norm_per_head else self.q_size)
            self.k_norm = qk_norm(head_dim if qk_norm_per_head else self.kv_size)
        self.rotary_emb = rotary
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32),
                                      requires_grad=False)
            self.sinks.keep_dtype = True  # type: ignore[attr-defined]
        self.attn = Attention(num_heads, num_kv_heads, head_dim,
                              head_dim ** -0.5 if scale is None else scale,
                              sliding_window=sliding_window, logit_softcap=logit_softcap)

    def per_head_rms_norms(self) -> tuple[RMSNorm, RMSNorm] | None | bool:
        """(q_norm, k_norm) when they are plain per-head RMSNorms (what the fused kernels
        take), None without q/k norms, False for any other kind."""
        if self.q_norm is None:
            return None
        if (self.qk_norm_per_head and type(self.q_norm) is RMSNorm
                and type(self.k_norm) is RMSNorm):
            return self.q_norm, self.k_norm  # type: ignore[return-value]
        return False

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.forward_qkv(positions, self.qkv_proj(hidden_states), attn_metadata)

    def forward_qkv(self, positions: torch.Tensor, qkv: torch.Tensor,
                    attn_metadata: AttentionMetadata) -> torch.Tensor:
        """From qkv_proj's output [num_tokens, q_size + 2 * kv_size] (a decoder layer that
        runs the projection itself can take its layer norm into the same launch)."""
        attn = self.attn
        if attn.kv_cache is None:
            raise RuntimeError("attention layer used before its KV cache was bound")
        out = attn.backend.fused_qkv(self, qkv, positions, attn.kv_cache, attn_metadata,
                                     attn.k_scale, attn.v_scale)
        if out is not None:
            return self.o_proj(out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            assert self.k_norm is not None
            n = q.shape[0]
            if self.qk_norm_per_head:  # [num_tokens, heads, head_dim] -> back
                q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).view(n, -1)
                k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).view(n, -1)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(attn(q, k, v, attn_metadata, sinks=self.sinks))


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
