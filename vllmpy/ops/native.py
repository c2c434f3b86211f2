"""The PyTorch implementations of the elementwise ops: what the layers run on the CPU, and
the references the Triton kernels beside them (``fused``, ``skinny_gemm``) are tested
against. Plain torch, no Triton import, so ``layers/`` may import it at the top."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32 and rounded to x's dtype
    before the weight multiplies it."""
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(orig_dtype)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_torch`` in fewer kernels, for the CPU (torch's ``rms_norm`` is not fused
    there: it is a composite of the reference's own fp32 steps).

    bfloat16 and float16 go through ``layer_norm``, which is one fused kernel: [x, -x] has
    mean 0 and variance mean(x^2), so its layer norm is x * rsqrt(mean(x^2) + eps) on the
    first half, normalised in fp32 and rounded to x's dtype. Its fp32 statistics differ from
    the reference's in the last bits, which the rounding hides on all but a few in 100,000
    values (those differ by one unit in the last place). float32 keeps the reference's
    exact numbers through ``rms_norm`` without a weight. The weight multiplies after the
    rounding, as in the reference.
    """
    if x.dtype in (torch.bfloat16, torch.float16):
        hidden = x.shape[-1]
        both = torch.cat([x, x.neg()], dim=-1)  # [..., 2 * hidden]
        normed = F.layer_norm(both, (2 * hidden,), None, None, eps)[..., :hidden]
    else:
        normed = torch.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    return weight * normed


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, rotary_dim]; cos/sin: [num_tokens, 1, rotary_dim / 2];
    # pairs are the two halves (NeoX)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # as _rotate, with pairs of neighbours (2i, 2i + 1) (GPT-J)
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


def rotary_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_dim: int, is_neox_style: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on q and k ([num_tokens, num_heads * head_dim] or [num_tokens, num_heads,
    head_dim]; the same shapes come back) in fp32, with ``cos_sin_cache`` [max_position,
    rotary_dim] (cos first half, sin second). The first rotary_dim dims of each head
    rotate, the rest pass through; pair i is dims (i, i + rotary_dim / 2) in the NeoX
    style and (2i, 2i + 1) otherwise (GPT-J)."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    n, q_size, k_size = q.shape[0], math.prod(q.shape[1:]), math.prod(k.shape[1:])
    # q and k in one pass (fewer ops): [num_tokens, num_heads + num_kv_heads, head_dim]
    qk = torch.cat([q.reshape(n, q_size), k.reshape(n, k_size)], dim=-1).view(n, -1, head_dim)
    rotate = _rotate if is_neox_style else _rotate_interleaved
    out = rotate(qk[..., :rotary_dim], cos, sin)
    if rotary_dim < head_dim:
        out = torch.cat([out, qk[..., rotary_dim:]], dim=-1)
    q_out, k_out = out.reshape(n, -1).split([q_size, k_size], dim=-1)
    return q_out.view(q.shape), k_out.view(k.shape)


def rotary_cpu_table(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """[max_position, 2, 1, rotary_dim]: [cos, cos] and [-sin, sin] of every position, from
    ``cos_sin_cache`` [max_position, rotary_dim] (cos first half, sin second)."""
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    table = torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)], dim=1)
    return table.unsqueeze(2)


def rotary_cpu(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               table: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_torch``'s numbers (NeoX style) in fewer calls, for the CPU: with ``table``
    from ``rotary_cpu_table``, both halves of the first rotary_dim dims of each head rotate
    at once as x * [cos, cos] + roll(x, rotary_dim / 2) * [-sin, sin], in fp32; the other
    dims pass through."""
    rotary_dim = table.shape[-1]
    cos, sin = table.index_select(0, positions).unbind(1)  # [num_tokens, 1, rotary_dim] each
    n, flat = q.shape[0], q.dim() == 2 and k.dim() == 2
    q2, k2 = (q, k) if flat else (q.reshape(n, -1), k.reshape(n, -1))
    # q and k in one pass: [num_tokens, num_heads + num_kv_heads, head_dim], fp32 and fresh
    qk = torch.cat([q2, k2], dim=-1)
    x = qk.view(n, -1, head_dim).float()  # cat's own output when q is fp32 already
    rot = x[..., :rotary_dim]  # a view: rotated in place, inside x
    rolled = rot.roll(rotary_dim // 2, dims=-1).mul_(sin)  # [-x2 * sin, x1 * sin]
    rot.mul_(cos).add_(rolled)
    out = x.to(q.dtype)
    q_out, k_out = out.view(n, -1).split([q2.shape[1], k2.shape[1]], dim=-1)
    return (q_out, k_out) if flat else (q_out.view(q.shape), k_out.view(k.shape))


def gelu_and_mul_torch(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x[..., :d]) * x[..., d:] ("tanh": the tanh approximation)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def gelu_new_torch(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's ``gelu_new``: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
