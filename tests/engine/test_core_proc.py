"""The engine core's wire format, its busy loop (driven over real ZMQ sockets from a
thread), start-up errors and shutdown of the core process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import zmq

from vllmpy.config import ConfigError, EngineArgs
from vllmpy.core.sched_output import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from vllmpy.engine import core_launch, core_proc
from vllmpy.engine.configure import build_engine_config
from vllmpy.engine.core import EngineCore, EngineCoreRequest
from vllmpy.engine.core_client import EngineStartupError
from vllmpy.engine.mp_client import AsyncMPClient
from vllmpy.loader.source import resolve_model_source
from vllmpy.sampling_params import RequestOutputKind, SamplingParams

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
          "torch_dtype": "float32"}


def tiny_source_and_config(path, config=CONFIG):
    (path / "config.json").write_text(json.dumps(config))
    args = EngineArgs(model=str(path), load_format="dummy", device="cpu", num_blocks=16,
                      max_model_len=256)
    source = resolve_model_source(args.model, load_format="dummy")
    return source, build_engine_config(args, source)


def request(req_id: str, max_tokens: int = 4, **params) -> EngineCoreRequest:
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, **params)
    return EngineCoreRequest(req_id, [1, 2, 3, 4, 5], sp, max_tokens, 1.0)


def test_wire_round_trip():
    req = request("r", stop=["x", "yz"], logit_bias={7: -1.5}, seed=3, stop_token_ids=[9],
                  output_kind=RequestOutputKind.DELTA)
    msg = core_proc.add_decoder.decode(
        core_proc.encoder.encode(core_proc.AddRequestMsg.from_request(req)))
    back = msg.to_request()
    assert back == req
    assert back.sampling_params.stop_strings == ["x", "yz"]
    assert back.sampling_params.output_kind is RequestOutputKind.DELTA
    outs = EngineCoreOutputs(
        [EngineCoreOutput("a", [1, 2], first_scheduled_time=5.0),
         EngineCoreOutput("b", [], finish_reason="stop", stop_reason="end", error=None),
         EngineCoreOutput("c", [3], finish_reason="stop", stop_reason=7)],
        SchedulerStats(2, 1, 0.25, 3, 17), 123.5)
    assert core_proc.outputs_decoder.decode(core_proc.encoder.encode(outs)) == outs


class LoopHarness:
    """An EngineCoreProc on a thread, driven over real ZMQ sockets."""

    def __init__(self, engine_core: EngineCore, tmp_path) -> None:
        self.ctx = zmq.Context()
        in_addr, out_addr = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
        core_in = self.ctx.socket(zmq.PULL)
        core_in.bind(in_addr)
        core_out = self.ctx.socket(zmq.PUSH)
        core_out.bind(out_addr)
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.connect(in_addr)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.connect(out_addr)
        self.proc = core_proc.EngineCoreProc(engine_core, core_in, core_out)
        self.thread = threading.Thread(target=self.proc.run_busy_loop, daemon=True)
        self.thread.start()

    def send(self, kind: bytes, obj) -> None:
        self.send_sock.send_multipart([kind, core_proc.encoder.encode(obj)])

    def recv(self):
        assert self.recv_sock.poll(10_000), "the busy loop sent nothing"
        kind, payload = self.recv_sock.recv_multipart()
        if kind == core_proc.OUTPUTS:
            return core_proc.outputs_decoder.decode(payload)
        return core_proc.utility_result_decoder.decode(payload)

    def run_until_finished(self, req_ids: set[str]) -> dict[str, list[EngineCoreOutput]]:
        got: dict[str, list[EngineCoreOutput]] = {}
        while req_ids - {r for r, outs in got.items() if outs[-1].finished}:
            for out in self.recv().outputs:
                got.setdefault(out.req_id, []).append(out)
        return got

    def close(self) -> None:
        self.proc.stopped = True
        self.thread.join(timeout=5)
        self.ctx.destroy(linger=0)


def test_busy_loop_serves_aborts_utilities_and_survives_a_failing_step(tmp_path):
    source, config = tiny_source_and_config(tmp_path)
    engine_core = EngineCore(config, source)
    loop = LoopHarness(engine_core, tmp_path)
    try:
        loop.send(core_proc.ADD, core_proc.AddRequestMsg.from_request(request("a")))
        outs = loop.run_until_finished({"a"})["a"]
        assert sum((o.new_token_ids for o in outs), []) and outs[-1].finish_reason == "length"
        assert outs[0].first_scheduled_time is not None
        assert all(o.first_scheduled_time is None for o in outs[1:])

        # a duplicate id is refused with an error output, not a dead loop
        loop.send(core_proc.ADD, core_proc.AddRequestMsg.from_request(request("long", 200)))
        loop.send(core_proc.ADD, core_proc.AddRequestMsg.from_request(request("long", 200)))
        refused = None
        while refused is None:
            refused = next((o for o in loop.recv().outputs if o.error is not None), None)
        assert refused.req_id == "long" and refused.finish_reason == "error"
        assert "already in use" in refused.error
        loop.send(core_proc.ABORT, ["long"])
        while (batch := loop.recv()).scheduler_stats.num_running_reqs:
            pass
        assert batch.scheduler_stats.kv_cache_usage == 0

        loop.send(core_proc.UTILITY, core_proc.UtilityCall(1, "get_stats", []))
        reply = loop.recv()
        assert reply.call_id == 1 and reply.error is None
        assert reply.result["num_running_reqs"] == 0
        # idle, so the prefix cache may be reset
        loop.send(core_proc.UTILITY, core_proc.UtilityCall(2, "reset_prefix_cache", []))
        assert loop.recv().result is True
        loop.send(core_proc.UTILITY, core_proc.UtilityCall(3, "shutdown_everything", []))
        assert "unknown engine core utility" in loop.recv().error

        runner = engine_core.model_runner
        real_execute = runner.execute_model

        def broken(_scheduler_output):
            runner.execute_model = real_execute
            raise RuntimeError("injected failure")

        runner.execute_model = broken
        loop.send(core_proc.ADD, core_proc.AddRequestMsg.from_request(request("bad")))
        failed = loop.run_until_finished({"bad"})["bad"][-1]
        assert failed.finish_reason == "error" and "injected failure" in failed.error
        loop.send(core_proc.ADD, core_proc.AddRequestMsg.from_request(request("good")))
        assert loop.run_until_finished({"good"})["good"][-1].finish_reason == "length"
        assert engine_core.kv_cache_manager.usage == 0
    finally:
        loop.close()
    assert not loop.thread.is_alive()


def test_startup_error_carries_the_core_message(tmp_path):
    import dataclasses

    source, config = tiny_source_and_config(tmp_path)
    # a model class the core cannot resolve: the failure happens inside the core process
    text = dataclasses.replace(config.model.text_config, architectures=["BloomForCausalLM"])
    config = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                   text_config=text))
    client = AsyncMPClient.from_config(config, source)
    with pytest.raises(EngineStartupError, match="BloomForCausalLM"):
        client.wait_until_ready()
    assert not client.proc.is_alive() and not os.path.exists(client._ipc_dir)


def test_shutdown_leaves_no_process_and_no_socket_files(tmp_path):
    source, config = tiny_source_and_config(tmp_path)
    client = AsyncMPClient.from_config(config, source)
    client.wait_until_ready()
    assert client.proc.is_alive() and os.listdir(client._ipc_dir)
    client.shutdown()
    assert not client.proc.is_alive() and client.proc.exitcode is not None
    assert not os.path.exists(client._ipc_dir)
    client.shutdown()  # idempotent


def test_a_core_started_from_arguments_sends_its_config_then_the_sized_pool(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu", num_blocks=16,
                      max_model_len=256)
    client = AsyncMPClient(core_launch.launch(args, core_launch.probable_device("cpu")))
    try:
        config, source = client.wait_for_config()
        assert (config.device, config.model.max_model_len) == ("cpu", 256)
        assert source.path == str(tmp_path) and source.hf_config["hidden_size"] == 64
        ready = client.wait_until_ready()
        assert ready.cache.num_blocks == 16 and ready.model.max_model_len == 256
        assert client.proc.is_alive()
    finally:
        client.shutdown()
    assert not client.proc.is_alive() and not os.path.exists(client._ipc_dir)


def test_a_config_the_core_refuses_is_raised_in_the_frontend(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu", num_blocks=16,
                      max_model_len=8192)  # the model has 4096 positions
    client = AsyncMPClient(core_launch.launch(args, "cpu"))
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        client.wait_for_config()
    assert not client.proc.is_alive() and not os.path.exists(client._ipc_dir)


def test_the_server_entry_starts_the_core_before_the_heavy_imports():
    script = ("import sys; import vllmpy.entrypoints.openai.api_server; "
              "print(sorted(m for m in ('torch', 'triton', 'fastapi', 'uvicorn', 'zmq') "
              "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# Frontend scripts start the core of the tiny model whose directory is their argument.
START_CLIENT = """
def start_client(model_dir):
    from vllmpy.config import ConfigError, EngineArgs
    from vllmpy.engine.configure import build_engine_config
    from vllmpy.engine.mp_client import AsyncMPClient
    from vllmpy.loader.source import resolve_model_source

    source = resolve_model_source(model_dir, load_format="dummy")
    config = build_engine_config(EngineArgs(model=model_dir, load_format="dummy",
                                            device="cpu", num_blocks=16, max_model_len=256),
                                 source)
    return AsyncMPClient.from_config(config, source)
"""

ORPHAN_SCRIPT = START_CLIENT + """
import os, signal, sys

if __name__ == "__main__":
    client = start_client(sys.argv[1])
    client.wait_until_ready()
    print(client.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no shutdown, no atexit: the frontend just dies
"""


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_core_exits_when_its_frontend_is_killed(tmp_path):
    tiny_source_and_config(tmp_path)  # writes config.json
    script = tmp_path / "frontend.py"
    script.write_text(ORPHAN_SCRIPT)
    frontend = subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert frontend.stdout is not None
    pid = int(frontend.stdout.readline())
    frontend.wait(timeout=30)
    frontend.stdout.close()
    deadline = time.monotonic() + 10
    while not _process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _process_gone(pid), f"engine core {pid} outlived its frontend"


MAIN_IMPORT_SCRIPT = START_CLIENT + """
import os, sys

if __name__ != "__main__":  # imported again, as a spawn child's __mp_main__
    with open(os.environ["MAIN_MARKER"], "w") as f:
        f.write(__name__)

if __name__ == "__main__":
    client = start_client(sys.argv[1])
    file_kept = __file__  # the main module's own attributes are back after the start
    client.wait_until_ready()
    client.shutdown()
    print("ok", file_kept == sys.argv[0], flush=True)
"""


def test_the_core_process_does_not_import_the_frontends_main_module(tmp_path):
    tiny_source_and_config(tmp_path)  # writes config.json
    script = tmp_path / "frontend.py"
    script.write_text(MAIN_IMPORT_SCRIPT)
    marker = tmp_path / "imported"
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, timeout=120,
                         env=dict(os.environ, MAIN_MARKER=str(marker)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "True"]
    assert not marker.exists()
