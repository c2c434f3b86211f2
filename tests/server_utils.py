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
