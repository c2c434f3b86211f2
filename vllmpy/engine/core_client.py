"""How the frontend talks to the engine core.

``EngineCoreClient`` is the synchronous contract and ``InprocClient`` runs the core in this
process (``LLM`` and tests). ``AsyncLLM`` uses an asynchronous client with the same calls
awaited: ``AsyncMPClient`` runs the core's busy loop in its own process (the server), and
``AsyncInprocClient`` steps an in-process core from the output task (debugging, tests).
"""

from __future__ import annotations

import asyncio
from typing import Any

from vllmpy.config import EngineConfig
from vllmpy.core.sched_output import EngineCoreOutputs
from vllmpy.engine.core import EngineCore, EngineCoreRequest
from vllmpy.loader.source import ModelSource


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message carries the core's own error."""


class EngineDeadError(RuntimeError):
    """The engine core process has died: every request in flight and every new one fails
    with this, and health checks fail."""


class EngineCoreClient:
    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        """Run (or wait for) one step and return its per-request deltas and stats."""
        raise NotImplementedError

    def has_unfinished_requests(self) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.engine_core = EngineCore(config, source)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()


class AsyncInprocClient:
    """The async client contract over an in-process EngineCore. ``get_output`` runs the
    step itself, on the event loop, and waits for work when there is none. A step that
    raises fails the running requests, as the engine-core process does."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.engine_core = EngineCore(config, source)
        self._wake: asyncio.Event | None = None
        self._stats_stale = False

    def _event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    async def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)
        self._event().set()

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)
        self._stats_stale = True
        self._event().set()

    async def get_output(self) -> EngineCoreOutputs:
        while True:
            if self.engine_core.has_unfinished_requests():
                await asyncio.sleep(0)  # let new requests and cancellations in first
                try:
                    return self.engine_core.step()
                except Exception as e:
                    return self.engine_core.fail_running_requests(f"{type(e).__name__}: {e}")
            if self._stats_stale:
                self._stats_stale = False
                return self.engine_core.make_outputs([])
            wake = self._event()
            wake.clear()
            await wake.wait()

    async def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, *args)

    def check_alive(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
