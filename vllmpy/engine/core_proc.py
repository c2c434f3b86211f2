"""The engine core in its own process: the wire format and the busy loop.

The frontend (``AsyncMPClient``) and the core talk over two ZMQ PUSH/PULL sockets on
``ipc://`` paths; the core binds both, the frontend connects. Every message is two frames,
a kind and a msgspec-msgpack payload:

  frontend -> core (input)    ADD      AddRequestMsg
                              ABORT    list[str] of request ids
                              UTILITY  UtilityCall
  core -> frontend (output)   OUTPUTS  EngineCoreOutputs (one per step, or stats only)
                              UTILITY_RESULT  UtilityResult

Start-up goes over a multiprocessing pipe: the child sends ("ready", pid) once the model,
the KV cache and both sockets are up, or ("error", text) and exits with status 1.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import traceback
from dataclasses import fields
from typing import Any

import msgspec
import zmq

from vllmpy.config import EngineConfig
from vllmpy.core.sched_output import EngineCoreOutput, EngineCoreOutputs
from vllmpy.engine.core import EngineCore, EngineCoreRequest
from vllmpy.loader.source import ModelSource
from vllmpy.pooling.params import PoolingParams
from vllmpy.sampling_params import RequestOutputKind, SamplingParams

ADD = b"add"
ABORT = b"abort"
UTILITY = b"utility"
OUTPUTS = b"outputs"
UTILITY_RESULT = b"utility_result"

# While idle the loop wakes this often to notice that its parent is gone.
IDLE_POLL_MS = 1000
# Steps failing back to back mean the model itself is broken: the process exits.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class AddRequestMsg(msgspec.Struct, array_like=True):
    """An EngineCoreRequest on the wire. SamplingParams travel as their init fields and
    are rebuilt on the core side (the frontend has validated them already)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    max_tokens: int
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    pooling_params: dict[str, Any] | None = None

    @classmethod
    def from_request(cls, req: EngineCoreRequest) -> AddRequestMsg:
        params = {f.name: getattr(req.sampling_params, f.name)
                  for f in fields(SamplingParams) if f.init}
        pooling = (None if req.pooling_params is None
                   else dataclasses.asdict(req.pooling_params))
        return cls(req.request_id, req.prompt_token_ids, params, req.max_tokens,
                   req.arrival_time, req.priority, req.cache_salt, pooling)

    def to_request(self) -> EngineCoreRequest:
        params = SamplingParams(**self.sampling_params)
        params.output_kind = RequestOutputKind(params.output_kind)
        pooling = (None if self.pooling_params is None
                   else PoolingParams(**self.pooling_params))
        return EngineCoreRequest(self.request_id, self.prompt_token_ids, params,
                                 self.max_tokens, self.arrival_time, self.priority,
                                 self.cache_salt, pooling)


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str  # one of EngineCore.UTILITY_METHODS
    args: list[Any]


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None  # set when the call raised; result is then None


encoder = msgspec.msgpack.Encoder()
add_decoder = msgspec.msgpack.Decoder(AddRequestMsg)
abort_decoder = msgspec.msgpack.Decoder(list[str])
utility_decoder = msgspec.msgpack.Decoder(UtilityCall)
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
utility_result_decoder = msgspec.msgpack.Decoder(UtilityResult)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class EngineCoreProc:
    """The busy loop: take every pending message, run one step if there is work and send
    its outputs, otherwise block on the input socket.

    After aborts with nothing left to run it still sends an (empty) EngineCoreOutputs so
    the frontend's gauges see the freed seats and blocks. A step that raises fails the
    requests of the running batch (finish_reason "error") and the loop goes on; after
    ``MAX_CONSECUTIVE_STEP_FAILURES`` in a row the exception propagates and the process
    ends, which the frontend sees as a dead engine.
    """

    def __init__(self, engine_core: EngineCore, input_socket: zmq.Socket,
                 output_socket: zmq.Socket, parent_pid: int | None = None) -> None:
        self.engine_core = engine_core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid  # exit when the parent is gone (None: never check)
        self.stopped = False  # set from another thread to end the loop (tests)
        self._stats_stale = False  # aborts since the last send
        self._refused: list[EngineCoreOutput] = []  # requests the core would not take
        self._consecutive_failures = 0

    def run_busy_loop(self) -> None:
        while not self.stopped:
            self._process_input(block=not self._has_work())
            if self.engine_core.has_unfinished_requests():
                self._send_outputs(self._step())
            elif self._stats_stale or self._refused:
                self._send_outputs(self.engine_core.make_outputs([]))

    def _has_work(self) -> bool:
        return (self.engine_core.has_unfinished_requests() or self._stats_stale
                or bool(self._refused))

    def _orphaned(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _process_input(self, block: bool) -> None:
        if block:
            while not self.input_socket.poll(IDLE_POLL_MS):
                if self.stopped or self._orphaned():
                    self.stopped = True
                    return
        while True:
            try:
                kind, payload = self.input_socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(kind, payload)
            except Exception as e:  # a malformed message must not end the loop
                print(f"vllmpy engine core: dropped a {kind!r} message: {describe(e)}",
                      file=sys.stderr, flush=True)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        if kind == ADD:
            msg = add_decoder.decode(payload)
            try:
                self.engine_core.add_request(msg.to_request())
            except Exception as e:
                self._refused.append(EngineCoreOutput(msg.request_id, [],
                                                      finish_reason="error", error=describe(e)))
        elif kind == ABORT:
            self.engine_core.abort_requests(abort_decoder.decode(payload))
            self._stats_stale = True
        elif kind == UTILITY:
            call = utility_decoder.decode(payload)
            try:
                reply = UtilityResult(call.call_id,
                                      self.engine_core.call_utility(call.method, *call.args))
            except Exception as e:
                reply = UtilityResult(call.call_id, error=describe(e))
            self._send(UTILITY_RESULT, encoder.encode(reply))
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def _step(self) -> EngineCoreOutputs:
        try:
            outputs = self.engine_core.step()
        except Exception as e:
            self._consecutive_failures += 1
            traceback.print_exc()
            if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            return self.engine_core.fail_running_requests(describe(e))
        self._consecutive_failures = 0
        self.engine_core.log_spec_decoding()
        return outputs

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        if self._refused:
            outputs.outputs = self._refused + outputs.outputs
            self._refused = []
        self._stats_stale = False
        self._send(OUTPUTS, encoder.encode(outputs))

    def _send(self, kind: bytes, payload: bytes) -> None:
        """Send when the frontend can take it; give up (and stop) if the parent is gone,
        so a core whose frontend died never blocks forever on a full pipe."""
        while not self.output_socket.poll(IDLE_POLL_MS, zmq.POLLOUT):
            if self.stopped or self._orphaned():
                self.stopped = True
                return
        self.output_socket.send_multipart([kind, payload])


def run_engine_core(config: EngineConfig, source: ModelSource, input_addr: str,
                    output_addr: str, ready_conn: Any) -> None:
    """Entry point of the engine-core process (started with the ``spawn`` context)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops us
    parent_pid = os.getppid()
    ctx = zmq.Context()
    try:
        engine_core = EngineCore(config, source)
        input_socket = ctx.socket(zmq.PULL)
        input_socket.bind(input_addr)
        output_socket = ctx.socket(zmq.PUSH)
        output_socket.bind(output_addr)
    except Exception as e:
        traceback.print_exc()
        ready_conn.send(("error", describe(e)))
        ready_conn.close()
        ctx.destroy(linger=0)
        sys.exit(1)
    ready_conn.send(("ready", engine_core.config))
    ready_conn.close()
    try:
        EngineCoreProc(engine_core, input_socket, output_socket, parent_pid).run_busy_loop()
    finally:
        ctx.destroy(linger=0)
