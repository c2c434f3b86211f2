"""Starting the engine-core process, light on both sides.

The frontend starts the core with ``spawn``. Nothing here imports torch, Triton or the
models, so a frontend can start the core before its own heavy imports (the server does,
right after parsing its flags) and the two processes import side by side.

The core is started either from the engine arguments (the core then resolves the model
and builds the config itself and sends them back first, so the frontend does not wait
for its own torch import to start the core) or from a config the frontend built.

In the child the target and its argument are light too (the start value arrives pickled
as bytes): the child starts its Triton compile workers (CUDA) before it imports torch,
so the workers' imports overlap its own (see vllmpy.ops.precompile).

Messages on the start-up pipe, child to frontend: ``("config", (config, source))`` when
started from arguments; then ``("ready", config)`` (the config with the KV pool sized)
or ``("error", message)``; or, instead of all of these, ``("config_error", exception)``
when the arguments do not make a config.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# How long stopping the core waits for it after SIGTERM, and then after SIGKILL.
SHUTDOWN_GRACE_S = 5.0


@dataclass
class CoreLaunch:
    """A started core process and the ends the frontend keeps."""

    proc: multiprocessing.process.BaseProcess
    conn: Any  # the start-up pipe's reading end
    ipc_dir: str
    input_addr: str
    output_addr: str

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and remove the socket files."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(SHUTDOWN_GRACE_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(SHUTDOWN_GRACE_S)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def launch(start: Any, device: str) -> CoreLaunch:
    """Start the core process from ``start``: EngineArgs, or an (EngineConfig,
    ModelSource) pair. ``device`` is the config's device, or for EngineArgs the flag's
    (``probable_device``): "cuda" starts the compile workers first."""
    ipc_dir = tempfile.mkdtemp(prefix="vllmpy-")
    input_addr = f"ipc://{os.path.join(ipc_dir, 'input')}"
    output_addr = f"ipc://{os.path.join(ipc_dir, 'output')}"
    mp = multiprocessing.get_context("spawn")
    conn, child_conn = mp.Pipe(duplex=False)
    proc = mp.Process(target=run, name="vllmpy-engine-core", daemon=True,
                      args=(pickle.dumps(start), device, input_addr, output_addr, child_conn))
    with _main_module_hidden():
        proc.start()
    child_conn.close()
    return CoreLaunch(proc, conn, ipc_dir, input_addr, output_addr)


def probable_device(device_flag: str) -> str:
    """The device ``--device`` will resolve to, guessed without importing torch: "auto"
    is CUDA where the NVIDIA driver's device node is. Only decides whether the core
    starts its compile workers ahead of its imports; the config resolves the device."""
    if device_flag == "auto":
        return "cuda" if os.path.exists("/dev/nvidiactl") else "cpu"
    return device_flag


def run(payload: bytes, device: str, input_addr: str, output_addr: str,
        ready_conn: Any) -> None:
    """Entry point of the engine-core process."""
    if device.startswith("cuda"):
        from vllmpy.ops import precompile

        precompile.start_early()
    start = pickle.loads(payload)
    if isinstance(start, tuple):
        config, source = start
    else:
        config, source = _configure(start, ready_conn)
    if config.device != "cuda":
        _stop_early_workers()
    from vllmpy.engine.core_proc import run_engine_core

    run_engine_core(config, source, input_addr, output_addr, ready_conn)


def _configure(engine_args: Any, ready_conn: Any) -> tuple[Any, Any]:
    """Resolve the model and build the config from the engine arguments, and send them to
    the frontend; on failure send the exception (the frontend raises it) and exit."""
    from vllmpy.engine.configure import build_engine_config, model_source

    try:
        source = model_source(engine_args)
        config = build_engine_config(engine_args, source)
    except Exception as e:  # noqa: BLE001 - every refusal reaches the frontend
        if not isinstance(e, ValueError):  # not a refusal: a bug, with its traceback here
            traceback.print_exc()
        _stop_early_workers()
        ready_conn.send(("config_error", _picklable(e)))
        ready_conn.close()
        sys.exit(1)
    ready_conn.send(("config", (config, source)))
    return config, source


def _picklable(error: Exception) -> Exception:
    """``error`` if it survives pickling, else a RuntimeError with its description."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _stop_early_workers() -> None:
    if "vllmpy.ops.precompile" in sys.modules:
        compiler = sys.modules["vllmpy.ops.precompile"].take_started()
        if compiler is not None:
            compiler.close()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a spawn child without it importing this process's main module.

    ``spawn`` makes the child import the parent's ``__main__`` (by module name or by path)
    so that objects pickled from it resolve. The engine core needs nothing from it (its
    target and arguments are vllmpy's), and for the server that import is the whole web
    stack, seconds of the core's start-up. multiprocessing reads ``__spec__`` and
    ``__file__`` of the main module while ``start()`` prepares the child; without them it
    leaves the child's main alone."""
    main = sys.modules["__main__"]
    saved = {name: getattr(main, name) for name in ("__spec__", "__file__")
             if hasattr(main, name)}
    main.__spec__ = None
    if "__file__" in saved:
        del main.__file__
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)
