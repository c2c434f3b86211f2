"""AsyncMPClient: the engine core's busy loop in its own process, over ZMQ + msgspec.

Kept apart from core_client.py so the library (``LLM``) needs neither zmq nor msgspec.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from typing import Any

import zmq
import zmq.asyncio

from vllmpy.config import EngineConfig
from vllmpy.core.sched_output import EngineCoreOutputs
from vllmpy.engine import core_launch, core_proc
from vllmpy.engine.core import EngineCoreRequest
from vllmpy.engine.core_client import EngineDeadError, EngineStartupError
from vllmpy.loader.source import ModelSource

# How often the output reader checks that the core process is alive while no message
# arrives; bounds how long a death goes unnoticed.
DEATH_CHECK_MS = 250


class AsyncMPClient:
    """The engine core's busy loop in a child process (``spawn``), over ZMQ + msgspec.

    It takes a core process already started (``core_launch.launch``, or ``from_config``)
    and returns at once; ``wait_until_ready()`` blocks until the core has loaded (raising
    EngineStartupError with the child's message).
    Outputs and utility replies are read by one task on the running event loop, started
    by the first async call; when the child dies that task fails ``get_output``, pending
    utility calls and every later call with EngineDeadError within DEATH_CHECK_MS.
    ``shutdown()`` (also run at exit, or when the client is collected) stops the child,
    closes the sockets and removes the socket files.
    """

    def __init__(self, launched: core_launch.CoreLaunch) -> None:
        """The client of a started core (``core_launch.launch``): from the engine
        arguments (its config then comes from ``wait_for_config()``) or from a config."""
        self.proc = launched.proc
        self._ready_conn = launched.conn
        self._ipc_dir = launched.ipc_dir
        self.ctx = zmq.asyncio.Context()
        # The frontend connects: a connecting PUSH socket queues messages even before (or
        # after) the peer is there, so a send never hangs on a dead core.
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)  # no limit: a send never waits
        self.input_socket.connect(launched.input_addr)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.connect(launched.output_addr)
        self._finalizer = weakref.finalize(self, _stop_core, launched, self.ctx)
        self._outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending_calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self.dead_error: EngineDeadError | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, source: ModelSource) -> AsyncMPClient:
        """Start a core from a config built here."""
        return cls(core_launch.launch((config, source), config.device))

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def wait_for_config(self) -> tuple[EngineConfig, ModelSource]:
        """The config and model source the core built from the engine arguments it was
        started with; raises what building them raised there (ConfigError, ...)."""
        return self._expect("config")

    def wait_until_ready(self) -> EngineConfig:
        """Block until the core has loaded; returns its config (with the KV pool sized)."""
        try:
            return self._expect("ready")
        finally:
            self._ready_conn.close()

    def _expect(self, wanted: str) -> Any:
        """The detail of the core's next start-up message of kind ``wanted`` (past a
        config nobody asked for); the core's refusal or failure is raised, and the core
        stopped."""
        try:
            status, detail = self._receive()
            while status == "config" and wanted != "config":
                status, detail = self._receive()
            if status == "config_error":
                raise detail
            if status != wanted:
                raise EngineStartupError(f"the engine core failed to start: {detail}")
        except BaseException:
            self.shutdown()
            raise
        return detail

    def _receive(self) -> tuple[str, Any]:
        """The next start-up message from the core (see vllmpy.engine.core_launch)."""
        while not self._ready_conn.poll(0.1):
            if not self.proc.is_alive() and not self._ready_conn.poll(0):
                raise EngineStartupError(
                    f"the engine core process exited with code {self.proc.exitcode} "
                    "before it was ready")
        try:
            return self._ready_conn.recv()
        except EOFError:
            self.proc.join(core_launch.SHUTDOWN_GRACE_S)
            raise EngineStartupError(
                f"the engine core process exited with code {self.proc.exitcode} "
                "before it was ready") from None

    # ---- requests -------------------------------------------------------------------

    async def add_request(self, request: EngineCoreRequest) -> None:
        msg = core_proc.AddRequestMsg.from_request(request)
        await self._send(core_proc.ADD, core_proc.encoder.encode(msg))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(core_proc.ABORT, core_proc.encoder.encode(request_ids))

    async def get_output(self) -> EngineCoreOutputs:
        queue = self._ensure_reader()
        item = await queue.get()
        if isinstance(item, BaseException):
            queue.put_nowait(item)  # so every later call fails the same way
            raise item
        return item

    async def call_utility(self, method: str, *args: Any) -> Any:
        self._ensure_reader()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        try:
            call = core_proc.UtilityCall(call_id, method, list(args))
            await self._send(core_proc.UTILITY, core_proc.encoder.encode(call))
            return await future
        finally:
            self._pending_calls.pop(call_id, None)

    def check_alive(self) -> None:
        """Raise EngineDeadError if the core process is gone."""
        if self.dead_error is None and not self.proc.is_alive():
            self._set_dead(self._death_error())
        if self.dead_error is not None:
            raise self.dead_error

    def shutdown(self) -> None:
        if self._reader is not None and not self._reader.done():
            with contextlib.suppress(RuntimeError):  # its event loop is already closed
                self._reader.cancel()
        self._finalizer()

    # ---- internals ------------------------------------------------------------------

    async def _send(self, kind: bytes, payload: bytes) -> None:
        self._ensure_reader()
        self.check_alive()
        await self.input_socket.send_multipart([kind, payload], copy=False)

    def _ensure_reader(self) -> asyncio.Queue[EngineCoreOutputs | BaseException]:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs())
        return self._outputs

    async def _read_outputs(self) -> None:
        try:
            while True:
                if not await self.output_socket.poll(DEATH_CHECK_MS):
                    self.check_alive()
                    continue
                kind, payload = await self.output_socket.recv_multipart()
                if kind == core_proc.OUTPUTS:
                    assert self._outputs is not None
                    self._outputs.put_nowait(core_proc.outputs_decoder.decode(payload))
                elif kind == core_proc.UTILITY_RESULT:
                    self._resolve_call(core_proc.utility_result_decoder.decode(payload))
        except asyncio.CancelledError:
            raise
        except EngineDeadError:
            pass  # check_alive has recorded it
        except BaseException as e:
            self._set_dead(EngineDeadError(f"lost the engine core's output stream: "
                                           f"{core_proc.describe(e)}"))

    def _resolve_call(self, reply: core_proc.UtilityResult) -> None:
        future = self._pending_calls.get(reply.call_id)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(RuntimeError(f"engine core utility call failed: "
                                              f"{reply.error}"))
        else:
            future.set_result(reply.result)

    def _death_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine core process (pid {self.proc.pid}) died with "
                               f"exit code {self.proc.exitcode}")

    def _set_dead(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
        if self._outputs is not None:
            self._outputs.put_nowait(error)
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(error)


def _stop_core(launched: core_launch.CoreLaunch, ctx: zmq.Context) -> None:
    """Stop the core process, close every socket and remove the socket files. Holds no
    reference to the client, so it can run from weakref.finalize and at exit."""
    launched.stop()
    ctx.destroy(linger=0)
