"""Programmatic dependent launch (PDL) for the decoder's Triton kernels.

On Hopper and newer GPUs a kernel launched with PDL may start while the kernel before it
is still draining: its programs get placed on the multiprocessors and can read what no
earlier kernel writes (a weight tile) before they block in ``griddepcontrol.wait``, which
returns once the previous kernel has finished and its writes are visible. A decode step
of a small model is a chain of several hundred short kernels, so the launch and the first
loads of each one overlap the tail of the one before.

The rule every kernel that takes ``PDL`` keeps: with ``PDL`` set it calls ``wait`` before
its first load of anything the kernel just before it may have written, and before its first
store, and only then ``launch_dependents``; every program waits, also one that has nothing
to do, before it exits. Waiting first makes the chain transitive: a kernel's programs start
only once every program of the kernel before has passed its wait, so whatever was written
two or more launches back (a step's inputs, earlier steps' KV cache) is finished when they
start and may be read before the wait, and a kernel that has passed its wait knows every
kernel before it in the stream has finished. A kernel launched without PDL (cuBLAS, a copy)
waits for the whole stream before it, as always. CUDA graph capture keeps these edges.

Usage: a kernel declares ``PDL: tl.constexpr`` and begins with ``pdl_wait(PDL)`` (after
any weight prefetch); its launch passes ``**pdl_args(tensor.device)``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllmpy import envs

try:  # Triton >= 3.3 exposes grid dependency control
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one launch (no-op without PDL)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=8)
def _supported(device: torch.device) -> bool:
    if (device.type != "cuda" or torch.version.hip is not None or gdc_wait is None
            or not envs.VT_TRITON_PDL):
        return False  # PDL is an NVIDIA feature (a ROCm build reports "cuda" too)
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch arguments for a kernel with a ``PDL`` constexpr on ``device``: PDL on a CUDA
    GPU of compute capability 9.0 or newer (unless ``VT_TRITON_PDL=0``), off elsewhere,
    including the CPU's interpreter."""
    if _supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
