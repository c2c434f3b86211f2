"""How the frontend talks to the engine core.

``EngineCoreClient`` is the contract; ``InprocClient`` runs the core in this process (the
library and tests). A multi-process client, with the core's busy loop in its own process,
implements the same three calls.
"""

from __future__ import annotations

from vllmpy.config import EngineConfig
from vllmpy.core.sched_output import EngineCoreOutput
from vllmpy.engine.core import EngineCore, EngineCoreRequest
from vllmpy.loader.source import ModelSource


class EngineCoreClient:
    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> list[EngineCoreOutput]:
        """Run (or wait for) one step and return its per-request deltas."""
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

    def get_output(self) -> list[EngineCoreOutput]:
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()
