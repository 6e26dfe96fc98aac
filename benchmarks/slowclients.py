"""Misbehaving clients on loopback: connections that idle, send their headers a line a second,
or stop their body halfway, held open against a server while ordinary clients use it.

    python benchmarks/slowclients.py --url http://127.0.0.1:8090 [--idle 100]
        [--slow-headers 100] [--slow-bodies 20] [--seconds 15]

As a command it checks what the service promises with those connections open: ``/healthz``
answers within a second every half second, ``/synthesize`` answers with audio, and the
misbehaving connections are closed by the server (an answer of 408 for those that had begun a
request, a closed connection for the rest; nginx closes both silently). Exit status 0 when all
of that held and no connection was refused. The container and replica tests run it; the
overload benchmark mixes ``SlowClients`` into its load.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

import requests

SLOW_BODY_HEAD = (
    b"POST /synthesize HTTP/1.1\r\nHost: slow\r\nContent-Type: application/json\r\n"
    b"Content-Length: 64\r\n\r\n"
)


class SlowClients:
    """``idle`` connections that send nothing, ``slow_headers`` that send a header line a
    second and never finish, ``slow_bodies`` that send their headers and then a byte of body a
    second. Each one the server closes is opened again (as a slowloris would), on a thread of
    its own, until the block ends; bounded by ``seconds`` and ``max_connections`` in all."""

    def __init__(
        self,
        host: str,
        port: int,
        idle: int = 0,
        slow_headers: int = 0,
        slow_bodies: int = 0,
        seconds: float = 600,
        max_connections: int = 20_000,
    ):
        self.address = (host, port)
        self.kinds = ["idle"] * idle + ["header"] * slow_headers + ["body"] * slow_bodies
        self.deadline = time.monotonic() + seconds
        self.budget = max_connections
        self.opened = 0
        self.answers: dict[str, int] = {}  # status line codes, or "closed" with no answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SlowClients:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _open(self, kind: str) -> socket.socket | None:
        if self.opened >= self.budget or time.monotonic() >= self.deadline:
            return None
        self.opened += 1
        try:
            sock = socket.create_connection(self.address, timeout=5)
            if kind == "header":
                sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            elif kind == "body":
                sock.sendall(SLOW_BODY_HEAD + b"{")
            sock.setblocking(False)
            return sock
        except OSError:
            self.answers["refused"] = self.answers.get("refused", 0) + 1
            return None

    def _closed_by_server(self, sock: socket.socket) -> bool:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        code = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
        self.answers[code] = self.answers.get(code, 0) + 1
        return True

    def _run(self) -> None:
        slots = [(kind, self._open(kind)) for kind in self.kinds]
        while not self._stop.wait(1.0) and time.monotonic() < self.deadline:
            for index, (kind, sock) in enumerate(slots):
                if sock is None or self._closed_by_server(sock):
                    if sock is not None:
                        sock.close()
                    slots[index] = (kind, self._open(kind))
                    continue
                try:
                    if kind == "header":
                        sock.send(b"X-Slow: 1\r\n")
                    elif kind == "body":
                        sock.send(b" ")
                except OSError:
                    pass
        for _, sock in slots:
            if sock is not None:
                sock.close()


def check(url: str, idle: int, slow_headers: int, slow_bodies: int, seconds: float) -> dict:
    """Probes and speech from ordinary clients while the slow ones are held open."""
    parts = urlsplit(url)
    probes, speech, errors = [], {}, []
    with SlowClients(parts.hostname, parts.port, idle, slow_headers, slow_bodies, seconds) as bad:
        time.sleep(1.0)  # every slow connection open and sending
        deadline = time.monotonic() + seconds - 1
        index = 0
        while time.monotonic() < deadline:
            began = time.monotonic()
            try:
                status = requests.get(url + "/healthz", timeout=5).status_code
                probes.append((status, time.monotonic() - began))
                if index % 4 == 0:
                    answer = requests.post(
                        url + "/synthesize", json={"text": "慢客户端。", "seed": index}, timeout=60
                    )
                    key = f"{answer.status_code} {answer.headers.get('Content-Type')}"
                    speech[key] = speech.get(key, 0) + 1
            except requests.RequestException as error:
                errors.append(error.__class__.__name__)
            index += 1
            time.sleep(max(0.0, 0.5 - (time.monotonic() - began)))
    result = {
        "slow_connections": dict(idle=idle, slow_headers=slow_headers, slow_bodies=slow_bodies),
        "connections_opened": bad.opened,
        "answers_to_slow_connections": bad.answers,
        "probes": len(probes),
        "probe_seconds_max": max((seconds for _, seconds in probes), default=None),
        "probe_failures": sum(1 for status, _ in probes if status != 200),
        "speech": speech,
        "errors": errors,
    }
    result["passed"] = (
        bool(probes)
        and result["probe_failures"] == 0
        and result["probe_seconds_max"] < 1.0
        and not errors
        and set(speech) == {"200 audio/wav"}
        and bad.answers.get("refused", 0) == 0
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the service, on loopback")
    parser.add_argument("--idle", type=int, default=100)
    parser.add_argument("--slow-headers", type=int, default=100)
    parser.add_argument("--slow-bodies", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=15)
    args = parser.parse_args()
    host = urlsplit(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        parser.error("slow clients are only sent to loopback")
    result = check(args.url, args.idle, args.slow_headers, args.slow_bodies, args.seconds)
    print(json.dumps(result))
    print(
        f"{result['connections_opened']} slow connections opened, the server's answers "
        f"{result['answers_to_slow_connections']}; {result['probes']} probes, the slowest "
        f"{result['probe_seconds_max'] or 0:.3f} s; speech {result['speech']}: "
        + ("passed" if result["passed"] else "FAILED"),
        file=sys.stderr,
    )
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
