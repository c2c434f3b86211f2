"""C kernels for the CPU (``csrc/*.c``), built on first use and called through ctypes.

The sources are compiled into one library once per machine with the system's C compiler
(``$CC``, else ``cc``) at ``-O3 -march=native -fopenmp`` into ``VT_KERNEL_CACHE`` (a file
named by a hash of the sources, the compiler and the CPU's flags), then loaded. No PyTorch headers are
involved, so a build takes about a second. The library's OpenMP calls run on the runtime
PyTorch has already loaded, so its threads are PyTorch's.

``kernels()`` returns the loaded library, or None when it cannot be had (no compiler, a
failed build, ``VT_CPU_KERNELS=0``); ``status()`` says which, for the start-up line. The
callers keep PyTorch's ops for that case and for what the kernels do not cover.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from vllmpy import envs

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))  # one library of them all
# -fno-trapping-math lets the clamped exp of SiLU and the softmax vectorize (no kernel reads
# floating-point exceptions)
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math",
         "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

# dtype codes of the C source
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64, _i32p, _i64p, _f32, _vp, _int = (ctypes.c_int64, ctypes.POINTER(ctypes.c_int32),
                                       ctypes.POINTER(ctypes.c_int64), ctypes.c_float,
                                       ctypes.c_void_p, ctypes.c_int)
_SIGNATURES = {
    "decode_attention": [_i64, _i64, _i64, _i64, _vp, _i64, _i64, _int, _vp, _vp, _vp, _int,
                         _i64, _i64, _i64, _i64, _vp, _i64, _vp, _vp, _f32, _f32, _i64, _vp,
                         _vp, _i64, _i64, _int, _int],
    "add_rms_norm": [_i64, _i64, _vp, _i64, _vp, _i64, _vp, _f32, _vp, _vp, _int, _int],
    "rotary_neox": [_i64, _vp, _vp, _i64, _i64, _vp, _i64, _i64, _i64, _i64, _vp, _int, _int],
    "silu_and_mul": [_i64, _i64, _vp, _i64, _vp, _int, _int],
    "gguf_linear": [_i64, _i64, _i64, _vp, _i64, _int, _vp, _i64, _int, _vp, _i64, _int,
                    _int],
    "gguf_dequantize": [_i64, _i64, _vp, _i64, _int, _vp, _int, _int],
    "f32_pack": [_i64, _i64, _vp, _i64, _vp, _int],
    "f32_linear": [_i64, _i64, _i64, _vp, _i64, _vp, _vp, _vp, _i64, _int],
}

_lock = threading.Lock()
_state: dict[str, object] = {}


def kernels() -> ctypes.CDLL | None:
    """The built library, or None (``status()`` says why)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"], _state["status"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def status() -> str:
    """How the CPU kernels stand, in a few words (for the start-up line)."""
    kernels()
    return str(_state["status"])


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _load() -> tuple[ctypes.CDLL | None, str]:
    if not envs.VT_CPU_KERNELS:
        return None, "off (VT_CPU_KERNELS=0): PyTorch ops"
    cc = _compiler()
    if cc is None:
        return None, "not built (no C compiler: set CC or install gcc): PyTorch ops"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"not built ({cc} --version failed: {e}): PyTorch ops"
    headers = sorted(SOURCES[0].parent.glob("*.h")) if SOURCES else []
    source = b"".join(path.read_bytes() for path in (*SOURCES, *headers))
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    cache = Path(envs.VT_KERNEL_CACHE)
    target = cache / f"cpu_kernels-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                return None, (f"not built ({cc} failed: {done.stderr.strip()[-300:]}): "
                              "PyTorch ops")
            os.replace(tmp, target)  # atomic: a concurrent build writes the same file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib, ("C kernels (decode attention, RMSNorm, rotary, SiLU-and-mul, GGUF "
                 "block matmul, float32 matmul)")


def code(dtype: torch.dtype) -> int | None:
    """The C source's code for ``dtype``; None for a dtype it does not take."""
    return DTYPE_CODES.get(dtype)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, kv_cache: torch.Tensor,
                     block_tables: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, softcap: float | None,
                     window: int | None, sinks: torch.Tensor | None, out: torch.Tensor,
                     threads: int) -> None:
    """One-token queries ``q[tokens[i]]`` ([tokens, heads, head_dim], heads contiguous)
    over request ``rows[i]``'s ``seq_lens[i]`` cached keys and values (``kv_cache`` [2,
    blocks, block_size, kv_heads, head_dim] of a dtype in ``DTYPE_CODES``), into
    ``out[tokens[i]]`` (q's layout). ``rows``, ``tokens``, ``seq_lens``: int64; ``sinks``:
    float32 [heads] or None."""
    _, _, block_size, kv_heads, dim = kv_cache.shape
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    lib.decode_attention(
        rows.shape[0], q.shape[1], kv_heads, dim, q.data_ptr(), q.stride(0), q.stride(1),
        DTYPE_CODES[q.dtype], tokens.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        DTYPE_CODES[kv_cache.dtype], kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_size, block_tables.data_ptr(), block_tables.stride(0), rows.data_ptr(),
        seq_lens.data_ptr(), scale, softcap or 0.0, window or 0, _ptr(sinks), out.data_ptr(),
        out.stride(0), out.stride(1), DTYPE_CODES[out.dtype], threads)


def add_rms_norm(lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor | None,
                 weight: torch.Tensor, eps: float, threads: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rms_norm_cpu(x + residual, weight, eps)`` and ``x + residual`` (None without a
    residual) for 2-D ``x`` whose rows are contiguous; the same dtype throughout."""
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    summed = None if residual is None else torch.empty(rows, hidden, dtype=x.dtype)
    lib.add_rms_norm(rows, hidden, x.data_ptr(), x.stride(0), _ptr(residual),
                     0 if residual is None else residual.stride(0), weight.data_ptr(), eps,
                     out.data_ptr(), _ptr(summed), DTYPE_CODES[x.dtype], threads)
    return out, summed


def rotary_neox(lib: ctypes.CDLL, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cos_sin: torch.Tensor, head_dim: int, threads: int) -> None:
    """NeoX rotary in place on 2-D ``q`` [tokens, heads * head_dim] and ``k`` (rows of
    contiguous heads) at int64 ``positions``, from float32 ``cos_sin`` [positions,
    rotary_dim]."""
    lib.rotary_neox(q.shape[0], positions.data_ptr(), q.data_ptr(), q.stride(0),
                    q.shape[1] // head_dim, k.data_ptr(), k.stride(0), k.shape[1] // head_dim,
                    head_dim, cos_sin.shape[1], cos_sin.data_ptr(), DTYPE_CODES[q.dtype],
                    threads)


def silu_and_mul(lib: ctypes.CDLL, x: torch.Tensor, threads: int) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for 2-D ``x`` with contiguous rows."""
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=x.dtype)
    lib.silu_and_mul(rows, d, x.data_ptr(), x.stride(0), out.data_ptr(),
                     DTYPE_CODES[x.dtype], threads)
    return out


# Elementwise calls over fewer values than this run on one thread: waking a second one
# costs more than it saves
SERIAL_ELEMENTS = 1 << 14


def threads_for(values: int) -> int:
    """The threads an elementwise call over ``values`` values runs on."""
    return 1 if values < SERIAL_ELEMENTS else torch.get_num_threads()


def takes_rows(*tensors: torch.Tensor) -> bool:
    """Whether the elementwise kernels take these tensors: 2-D CPU tensors of one dtype
    they know, each row contiguous."""
    first = tensors[0]
    return all(t.dim() == 2 and t.stride(1) == 1 and t.dtype == first.dtype
               and t.device.type == "cpu" for t in tensors) and first.dtype in DTYPE_CODES
