"""The engine-core process's first steps, before its heavy imports.

The frontend starts the core with ``spawn``; the child unpickles its target and arguments
and then runs it. This module's target is light, and the configuration arrives pickled
as bytes, so the child can start its Triton compile workers (CUDA) before it imports
torch, Triton and the models: the workers' own imports then overlap the child's instead
of following them (see vllmpy.ops.precompile).
"""

from __future__ import annotations

import pickle
from typing import Any


def run(payload: bytes, device: str, input_addr: str, output_addr: str,
        ready_conn: Any) -> None:
    """Entry point of the engine-core process: ``payload`` is the pickled (EngineConfig,
    ModelSource) pair; ``device`` the config's device ("cuda" starts the compile workers
    first)."""
    if device.startswith("cuda"):
        from vllmpy.ops import precompile

        precompile.start_early()
    config, source = pickle.loads(payload)
    from vllmpy.engine.core_proc import run_engine_core

    run_engine_core(config, source, input_addr, output_addr, ready_conn)
