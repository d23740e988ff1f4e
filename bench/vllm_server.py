"""vLLM's OpenAI-compatible server for the benches: started with the engine arguments chandrad's
in-process engine would get (``plan_engines``), so that "remote" and "in-process" differ only in
the HTTP hop; killed with SIGKILL and started again on the same port; left running between two
device calls (its own session, described in a JSON file) so the next call need not start it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

# Engine arguments whose vLLM default is True: False must be said (``--no-...``); any other False
# is vLLM's default and is left out (``--enforce-eager`` and friends are plain flags).
DEFAULT_TRUE = {"enable_prefix_caching"}
# The daemon reads the scheduler's numbers itself; the server logs its own every 10 s (cheap).
NOT_FOR_THE_SERVER = {"model", "disable_log_stats", "served_model_name"}


def serve_arguments(engine_args: dict[str, Any]) -> list[str]:
    """AsyncEngineArgs keywords as ``vllm serve`` options (dicts and lists as JSON)."""
    words: list[str] = []
    for key, value in engine_args.items():
        if key in NOT_FOR_THE_SERVER or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif value is False:
            if key in DEFAULT_TRUE:
                words.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list, tuple)):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, str(value)]
    return words


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class VllmServer:
    """One ``vllm serve`` on 127.0.0.1:port serving ``name``; its log appended to ``log_path``."""

    def __init__(self, command: list[str], env: dict[str, str], port: int, log_path: str, pid: int | None = None):
        self.command, self.env, self.port, self.log_path, self.pid = command, env, port, log_path, pid
        self.lives: list[dict[str, float]] = []

    @classmethod
    def for_engine(cls, model: str, engine_args: dict[str, Any], env: dict[str, str], log_path: Path,
                   name: str = "chandra") -> VllmServer:
        port = free_port()
        # The api_server module rather than the `vllm serve` CLI: the CPU build's CLI looks for a
        # distribution named "vllm"; both take the same options.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
                   "--disable-uvicorn-access-log", *serve_arguments(engine_args)]
        return cls(command, env, port, str(log_path))

    @classmethod
    def load(cls, path: Path) -> VllmServer:
        data = json.loads(path.read_text())
        server = cls(data["command"], data["env"], data["port"], data["log_path"], data.get("pid"))
        server.lives = data.get("lives", [])
        return server

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"command": self.command, "env": self.env, "port": self.port,
                                    "log_path": self.log_path, "pid": self.pid, "lives": self.lives}, indent=1))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> VllmServer:
        """Start it in a session of its own (it outlives the device call that started it)."""
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(self.command, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = proc.pid
        self.lives.append({"started_at": time.time()})
        return self

    def alive(self) -> bool:
        from chandrad.engine.processes import running  # the chandrad measured (--src) is on sys.path by now

        return self.pid is not None and running(self.pid)

    def answering(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as health:
                if health.status != 200:
                    return False
            with urllib.request.urlopen(f"{self.url}/models", timeout=2) as models:
                return models.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> float:
        """Seconds waited; RuntimeError with the log's end if it died or did not answer in time."""
        t = time.monotonic()
        while not self.answering():
            if not self.alive():
                raise RuntimeError(f"vllm serve exited at start:\n{Path(self.log_path).read_text()[-4000:]}")
            if time.monotonic() - t > timeout:
                raise RuntimeError(f"vllm serve did not answer within {timeout:.0f} s")
            time.sleep(0.5)
        if self.lives and "ready_at" not in self.lives[-1]:
            self.lives[-1]["ready_at"] = time.time()
        return time.monotonic() - t

    def kill9(self) -> float:
        """SIGKILL to its whole process group (API server and EngineCore); the time it was sent."""
        at = time.time()
        if self.pid is not None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._wait_gone(30)
        if self.lives:
            self.lives[-1]["killed_at"] = at
        return at

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM, then SIGKILL: the GPU must be free for what runs next."""
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        self._wait_gone(timeout)
        self.kill9()

    def _wait_gone(self, timeout: float) -> None:
        """Until its process is gone (reaped, if it is our child) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while self.pid is not None and self.alive() and time.monotonic() < deadline:
            try:
                os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)
