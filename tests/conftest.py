"""Shared fixtures: the tiny random-weight model, and a real server process on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from chattts_service.testmodel import build

    return build(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python server.py`` as a user runs it, on a free loopback port."""

    def __init__(self, model_dir: Path, log_path: Path, port: int | None = None, **settings: str):
        self.port = port or free_port()
        self.model_dir = model_dir
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATTTS_")}
        env.update({
            "CHATTTS_HOST": "127.0.0.1",
            "CHATTTS_PORT": str(self.port),
            "CHATTTS_MODEL_DIR": str(model_dir),
            "CHATTTS_VERIFY_MODEL": "0",
            "CHATTTS_MAX_NEW_TOKENS": "200",
            "CHATTTS_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        })
        env.update(settings)
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen([sys.executable, "server.py"], cwd=REPO, env=env,
                                        stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                requests.get(self.url + "/healthz", timeout=1)
                return
            except requests.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError(f"server did not listen within {timeout}s:\n{self.log()}")

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready within {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="session")
def start_server(tiny_model_dir, tmp_path_factory):
    """Start extra servers with their own settings; every one is stopped at the end."""
    started: list[ServerProcess] = []

    def start(model_dir: Path | None = None, **settings: str) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(model_dir or tiny_model_dir, log_path, **settings)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
