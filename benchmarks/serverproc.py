"""A ``python server.py`` child on a loopback port, optionally inside a cgroup v1 memory limit,
and nginx with the shipped configuration in front of such children: for the overload, soak and
replica scripts and the replica test."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
MEMORY_CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
NGINX_CONFIG = REPO / "deploy" / "nginx" / "chattts.conf"


def model_arguments(
    parser: argparse.ArgumentParser, rounds: int, endless: bool = True
) -> argparse.Namespace:
    """``--model-dir``, ``--rounds`` and ``--json`` (and for ``endless``, ``--max-new-tokens``:
    each segment's steps), parsed. The model is by default the full-size random one whose
    speech never ends (``endless``) or the one whose speech ends as a sentence's does; an error
    says how to build it when it is missing."""
    name = "full-endless" if endless else "full-random"
    parser.add_argument("--model-dir", type=Path, default=REPO / "models" / name)
    parser.add_argument("--rounds", type=int, default=rounds)
    if endless:
        parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not (args.model_dir / "architecture.json").is_file():
        parser.error(
            f"no model in {args.model_dir}: python -m chattts_service.tools.testmodel "
            f"{args.model_dir} --size full{' --endless' if endless else ''}"
        )
    return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory directory, where child groups may be made."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                directory = MEMORY_CGROUP_ROOT / path.lstrip("/")
                return directory if directory.is_dir() else None
    except OSError:
        return None
    return None


class MemoryCgroup:
    """A child memory cgroup with a hard limit; removed on close."""

    def __init__(self, limit_bytes: int):
        parent = own_memory_cgroup()
        if parent is None:
            raise RuntimeError("no cgroup v1 memory controller to make a limit with")
        self.path = parent / f"chattts-bench-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        self.limit = limit_bytes

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def usage(self) -> int:
        return int(self.read("memory.usage_in_bytes"))

    def max_usage(self) -> int:
        return int(self.read("memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        for line in self.read("memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def failcnt(self) -> int:
        return int(self.read("memory.failcnt"))

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


class Server:
    """``python server.py`` as a user runs it, on a loopback port (a free one unless given),
    optionally inside a memory cgroup."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        cgroup: MemoryCgroup | None = None,
        port: int | None = None,
        **settings: str,
    ):
        self.port = port or free_port()
        self.model_dir = model_dir
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATTTS_")}
        env.update(
            {
                "CHATTTS_HOST": "127.0.0.1",
                "CHATTTS_PORT": str(self.port),
                "CHATTTS_MODEL_DIR": str(model_dir),
                "CHATTTS_VERIFY_MODEL": "0",
                # stored voices and consents beside the log, never in the checkout
                "CHATTTS_VOICES_DIR": str(Path(log_path).parent / "voices"),
                "PYTHONUNBUFFERED": "1",
                # Home Assistant's port off unless a test asks for it: servers side by side
                # would contend for its default
                "CHATTTS_WYOMING_PORT": "0",
                **settings,
            }
        )
        command = [sys.executable, "server.py"]
        if cgroup is not None:  # the shell joins the group, then becomes the server
            command = [
                "sh",
                "-c",
                f'echo $$ > "{cgroup.path}/cgroup.procs" && exec "$@"',
                "sh",
                *command,
            ]
        self._log = open(log_path, "wb")  # noqa: SIM115 (open for the process's lifetime)
        self.log_path = log_path
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _check_running(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"server exited with {self.process.returncode}:\n{self.log()[-6000:]}"
            )

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_running()
            try:
                requests.get(self.url + "/healthz", timeout=1)
                return
            except requests.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError(f"server did not listen within {timeout} s:\n{self.log()[-6000:]}")

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Seconds until /readyz said 200."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            self._check_running()
            try:
                if requests.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except (requests.ConnectionError, requests.Timeout):
                pass  # not listening yet, or too busy starting up to answer
            time.sleep(0.1)
        raise TimeoutError(f"server not ready within {timeout} s:\n{self.log()[-6000:]}")

    def pids(self) -> list[int]:
        """The arbiter and its worker(s)."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.process.pid)], capture_output=True, text=True
        ).stdout.split()
        return [self.process.pid, *map(int, out)]

    def rss_mb(self) -> float:
        total = 0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024

    def stop(self) -> int | None:
        """SIGTERM (a graceful drain), SIGKILL after 60 s; the exit status."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._log.close()
        return self.process.returncode


class Nginx:
    """Debian's nginx running deploy/nginx/chattts.conf as shipped, except that its replica
    lines become one line per loopback ``backends`` port (same parameters) and it listens on a
    free loopback port."""

    def __init__(self, prefix: Path, backends: list[int], nginx: str = "nginx"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefix = prefix
        lines = NGINX_CONFIG.read_text().splitlines(keepends=True)
        shipped = [line for line in lines if line.strip().startswith("server chattts-")]
        first = lines.index(shipped[0])
        kept = [line for line in lines if line not in shipped]
        kept.insert(
            first,
            "".join(
                re.sub(r"chattts-\d+:8090", f"127.0.0.1:{port}", shipped[0]) for port in backends
            ),
        )
        config = "".join(kept).replace("listen 8090", f"listen 127.0.0.1:{self.port}")
        prefix.mkdir(parents=True, exist_ok=True)
        (prefix / "chattts.conf").write_text(config)
        (prefix / "nginx.conf").write_text(
            f"pid {prefix}/nginx.pid; error_log {prefix}/error.log warn; daemon off;\n"
            "worker_processes 1;\nevents { worker_connections 512; }\n"
            f"http {{ access_log off; client_body_temp_path {prefix}/body;"
            f" proxy_temp_path {prefix}/proxy; include chattts.conf; }}\n"
        )
        self.process = subprocess.Popen(
            [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                requests.get(self.url + "/healthz", timeout=1)
                return
            except requests.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError((prefix / "error.log").read_text())

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
