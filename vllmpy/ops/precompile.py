"""Compile a start-up's Triton kernel variants in parallel, ahead of their first launch.

Triton compiles a kernel variant (its constexprs, launch options and the specialization
of its arguments) the first time it is launched, one variant after another, 0.2-1.5 s
each; a CUDA start-up launches a couple of dozen (the prefill and decode paths, every
CUDA graph's batch shape). From an empty kernel cache that is most of the start-up.

Two parts:
- ``record_variants()``: inside it, a Triton launch of a variant this process has not
  compiled yet is recorded and neither compiled nor launched (Triton's
  ``jit_cache_hook``). Running the start-up's forwards inside it lists their variants;
  their outputs are garbage and are thrown away.
- ``KernelCompiler``: worker processes (``python -m vllmpy.ops.precompile``), started
  early so their imports overlap the model load, that compile recorded variants with
  Triton's ``JITFunction.preload``. That writes each one to Triton's on-disk cache
  (``TRITON_CACHE_DIR``, which the workers inherit), and the real first launch in this
  process then loads it from there instead of compiling.

A variant a worker fails to compile is reported and then compiles at its first launch as
it always would; nothing depends on the workers for correctness.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

# Worker processes when VT_COMPILE_WORKERS is unset: one per spare core, at most this many
# (each holds an imported torch and an LLVM context, about 1 GB of host memory).
DEFAULT_MAX_WORKERS = 8


@dataclass(frozen=True)
class KernelVariant:
    """One compiled form of a Triton kernel: where the kernel lives and Triton's
    serialized specialization (signature, constexprs, attributes, options)."""

    module: str
    qualname: str
    specialization: str

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


@contextlib.contextmanager
def record_variants() -> Iterator[list[KernelVariant]]:
    """Record, instead of compiling and launching, every Triton kernel variant launched
    inside the block that this process has not compiled yet; yields the list, filled
    (distinct variants, in launch order) when the block exits. Launches of variants
    already compiled run as usual."""
    from triton import knobs

    seen: dict[tuple[str, str, str], KernelVariant] = {}

    def hook(*, key, fn, compile, **_):  # noqa: A002 - Triton's keyword names
        ident = (fn.module, fn.name, str(key))
        if ident not in seen:
            seen[ident] = KernelVariant(fn.module, fn.name, compile["specialization_data"])
        return True  # skip: no compile, no launch

    out: list[KernelVariant] = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield out
    finally:
        knobs.runtime.jit_cache_hook = previous
        out.extend(seen.values())


def default_num_workers() -> int:
    """VT_COMPILE_WORKERS if set (0 turns parallel compiling off), else one per spare core
    up to DEFAULT_MAX_WORKERS."""
    from vllmpy import envs

    configured = envs.VT_COMPILE_WORKERS
    if configured is not None:
        if configured < 0:
            raise ValueError(f"VT_COMPILE_WORKERS must be 0 or more, got {configured}")
        return configured
    return max(0, min(DEFAULT_MAX_WORKERS, (os.cpu_count() or 1) - 1))


@dataclass
class CompileReport:
    variants: int  # distinct variants asked for
    here: int  # of them, compiled (or found in the disk cache) by the calling process
    in_workers: int  # compiled by the workers
    failed: list[str]  # "kernel: error" per variant not compiled, "worker: error" per
    # worker that could not start
    seconds: float  # wall time of ``compile``
    slowest: str  # the slowest variant and its compile time, wherever it compiled


class KernelCompiler:
    """``num_workers`` worker processes that compile kernel variants into Triton's disk
    cache, started at construction (their imports take seconds: start it early).

    ``compile(variants)`` works through the variants as one queue: each worker that is
    ready takes the next one, and so does the calling process whenever no worker is free
    (it compiles in-process with ``JITFunction.preload``, or loads the variant from the
    disk cache in milliseconds when it is already there, so a warm cache never waits for
    the workers' imports). It returns when every variant is done and ends the workers."""

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"KernelCompiler needs at least one worker, got {num_workers}")
        # the workers import what this process imports: its module search path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        self._procs: list[subprocess.Popen] = []
        try:
            for _ in range(num_workers):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "vllmpy.ops.precompile"], env=env,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True, bufsize=1))
        except OSError:  # no more processes: end the ones started, and say so
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        return len(self._procs)

    def compile(self, variants: list[KernelVariant], *, in_process: bool = True) -> CompileReport:
        """Compile ``variants``; ``in_process=False`` leaves every one to the workers."""
        start = time.perf_counter()
        todo = list(variants)
        failed: list[str] = []
        here = in_workers = 0
        slowest = (0.0, "")
        sel = selectors.DefaultSelector()
        busy: dict[int, KernelVariant] = {}  # worker -> the variant it is compiling
        idle: list[int] = []  # workers ready for the next variant
        try:
            for i, proc in enumerate(self._procs):
                assert proc.stdout is not None
                sel.register(proc.stdout, selectors.EVENT_READ, i)
            while todo or busy:
                while todo and idle:
                    i = idle.pop()
                    if self._send(i, todo[0]):
                        busy[i] = todo.pop(0)
                    # else the worker is gone: its output ends, and the loop drops it
                if not todo and not busy:
                    break
                if todo and in_process:  # no worker free: compile the next one here
                    variant = todo.pop(0)
                    t = time.perf_counter()
                    error = _preload(variant.module, variant.qualname, variant.specialization)
                    t = time.perf_counter() - t
                    if error:
                        failed.append(f"{variant.name}: {error}")
                    else:
                        here += 1
                        slowest = max(slowest, (t, variant.name))
                    events = sel.select(timeout=0)
                elif sel.get_map():
                    events = sel.select()
                else:  # every worker is gone and nothing may compile here
                    failed += [f"{v.name}: no worker left" for v in todo]
                    break
                for key, _ in events:
                    i = key.data
                    line = key.fileobj.readline()  # type: ignore[union-attr]
                    reply = json.loads(line) if line else {"error": "exited"}
                    done = busy.pop(i, None)
                    if done is not None:
                        if "error" in reply:
                            failed.append(f"{done.name}: {reply['error']}")
                        else:
                            in_workers += 1
                            slowest = max(slowest, (reply["seconds"], done.name))
                    elif "error" in reply:  # the worker could not start
                        failed.append(f"worker: {reply['error']}")
                    if not line or (done is None and "error" in reply):
                        sel.unregister(key.fileobj)
                    else:
                        idle.append(i)
        finally:
            sel.close()
            self.close()
        return CompileReport(len(variants), here, in_workers, failed,
                             time.perf_counter() - start,
                             f"{slowest[1]} {slowest[0]:.2f} s" if slowest[1] else "")

    def _send(self, i: int, variant: KernelVariant) -> bool:
        """Hand ``variant`` to worker ``i``; False if that worker has exited."""
        stdin = self._procs[i].stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps({"module": variant.module, "qualname": variant.qualname,
                                    "specialization": variant.specialization}) + "\n")
            stdin.flush()
        except OSError:  # a broken pipe
            return False
        return True

    def close(self) -> None:
        """End the workers: those still importing or waiting are stopped (a worker only
        writes the cache between receiving a variant and replying, and every variant has
        its reply once ``compile`` ends)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


_started: KernelCompiler | None = None  # workers started early, until taken


def start_early() -> None:
    """Start this process's compile workers now (``default_num_workers()`` of them), ahead
    of its own heavy imports, for ``take_started()`` to hand over later."""
    global _started
    # On a bad VT_COMPILE_WORKERS or no processes to spare, nothing starts here: the engine
    # tries again at its model load, where the error reaches the frontend as a start-up
    # failure (or a logged line).
    with contextlib.suppress(OSError, ValueError):
        workers = default_num_workers()
        if _started is None and workers:
            _started = KernelCompiler(workers)


def take_started() -> KernelCompiler | None:
    """The workers ``start_early`` started, once; None if it did not."""
    global _started
    compiler, _started = _started, None
    return compiler


def _preload(module: str, qualname: str, specialization: str) -> str:
    """Compile one variant into this process's kernels and Triton's disk cache (or load it
    from there); returns "" or the error."""
    import importlib

    try:
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        fn.preload(specialization)
    except Exception as e:  # noqa: BLE001 - reported by the caller, which carries on
        return f"{type(e).__name__}: {e}"
    return ""


def _worker() -> None:
    """Compile the variants that arrive on stdin, one JSON object per line; answer each
    with {"seconds"} or {"error"}, after a first {"ready"} once the imports are done."""
    import importlib

    # The replies get their own copy of stdout; anything else printed goes to stderr.
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(**fields) -> None:
        channel.write(json.dumps(fields) + "\n")
        channel.flush()

    try:
        import triton

        triton.runtime.driver.active.get_current_target()  # the device query, done early
        # the modules that hold the engine's kernels
        for name in ("vllmpy.ops.fused", "vllmpy.ops.paged_attention",
                     "vllmpy.ops.decode_attention", "vllmpy.ops.skinny_gemm"):
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which carries on
        reply(error=f"{type(e).__name__}: {e}")
        return
    reply(ready=True)
    for line in sys.stdin:
        start = time.perf_counter()
        try:
            job = json.loads(line)
            error = _preload(job["module"], job["qualname"], job["specialization"])
        except Exception as e:  # noqa: BLE001 - a malformed job: reported, not fatal
            error = f"{type(e).__name__}: {e}"
        if error:
            reply(error=error)
        else:
            reply(seconds=time.perf_counter() - start)


if __name__ == "__main__":
    _worker()
