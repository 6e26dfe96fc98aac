"""Two replicas behind the shipped nginx configuration (Debian's nginx; only the replicas'
addresses are changed, see ``benchmarks.serverproc.Nginx``), all on loopback: the
load spreads over both; one replica killed mid-load costs no request more than a deliberate
503, except an answer it was in the middle of writing, which the client sees cut short; the
replica rejoins once it is ready again; idle and slow clients starve neither nginx nor a
replica."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections import Counter

import pytest
import requests
from conftest import ServerProcess

from benchmarks.serverproc import Nginx
from benchmarks.slowclients import check

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def served(server) -> float:
    """Requests a replica answered with audio."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('chatts_requests_total{status="200"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def replicas(tiny_model_dir, tmp_path):
    settings = {"CHATTTS_MAX_NEW_TOKENS": "150", "CHATTTS_MAX_QUEUE": "16"}
    servers = [
        ServerProcess(tiny_model_dir, tmp_path / f"replica-{i}.log", **settings) for i in (1, 2)
    ]
    for server in servers:
        server.wait_ready()
    proxy = Nginx(tmp_path / "nginx", [server.port for server in servers], NGINX)
    yield servers, proxy, settings
    proxy.stop()
    for server in servers:
        server.stop()


def load(url: str, seconds: float, clients: int, outcomes: list, stop: threading.Event):
    def client(offset: int):
        session = requests.Session()
        index = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not stop.is_set():
            index += 1
            try:
                response = session.post(
                    url + "/synthesize",
                    timeout=60,
                    json={
                        "text": "负载均衡测试，第几句话都可以。",
                        "seed": offset * 10_000 + index,
                    },
                )
                ok = response.status_code != 200 or response.content[:4] == b"RIFF"
                outcomes.append((response.status_code, ok, time.monotonic()))
            except requests.RequestException as error:
                outcomes.append((error.__class__.__name__, False, time.monotonic()))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def test_load_spreads_survives_a_killed_replica_and_it_rejoins(replicas, tmp_path):
    (first, second), proxy, settings = replicas
    outcomes: list = []
    stop = threading.Event()

    threads = load(proxy.url, 6, 8, outcomes, stop)
    for thread in threads:
        thread.join()
    assert outcomes and all(status == 200 and ok for status, ok, _ in outcomes), outcomes[:5]
    assert served(first) > 0 and served(second) > 0, "nginx sent everything to one replica"

    # kill one replica in the middle of the load
    outcomes.clear()
    threads = load(proxy.url, 8, 8, outcomes, stop)
    time.sleep(2)
    killed_at = time.monotonic()
    os.killpg(second.process.pid, signal.SIGKILL)
    second.process.wait(timeout=10)
    for thread in threads:
        thread.join()
    # Audio or a deliberate 503; a request the replica had not begun to answer goes to the
    # other one. The one exception: an answer the replica was writing when it was killed.
    # nginx has already passed its headers on and cannot try again elsewhere, so it closes
    # the connection short of the Content-Length; the client detects that (requests raises
    # ChunkedEncodingError) and never takes the cut body for audio. Such a cut can only
    # happen at the kill, to requests that were in flight then: at most one per client.
    cut = [finished for status, _, finished in outcomes if status == "ChunkedEncodingError"]
    others = Counter(
        status for status, _, _ in outcomes if status not in (200, 503, "ChunkedEncodingError")
    )
    log = (proxy.prefix / "error.log").read_text()[-3000:]
    assert not others, (others, log)
    assert len(cut) <= 8 and all(killed_at <= finished < killed_at + 5 for finished in cut), (
        [finished - killed_at for finished in cut],
        log,
    )
    assert all(ok for status, ok, _ in outcomes if status in (200, 503))
    assert sum(1 for status, _, _ in outcomes if status == 200) > 0

    # the replica comes back on its port and nginx sends it work again once it is ready
    back = ServerProcess(
        second.model_dir, tmp_path / "replica-2-again.log", port=second.port, **settings
    )
    try:
        back.wait_ready()
        outcomes.clear()
        deadline = time.monotonic() + 30
        while served(back) == 0 and time.monotonic() < deadline:
            threads = load(proxy.url, 2, 4, outcomes, stop)
            for thread in threads:
                thread.join()
        assert served(back) > 0, "the restarted replica got no work"
        assert all(status == 200 and ok for status, ok, _ in outcomes)
    finally:
        back.stop()


def test_slow_and_idle_clients_through_nginx_leave_both_replicas_serving(replicas):
    servers, proxy, _ = replicas
    # through the proxy, and straight at a replica (as a probe or a pod's neighbour would be)
    for url in (proxy.url, servers[0].url):
        result = check(url, idle=150, slow_headers=150, slow_bodies=20, seconds=14)
        assert result["passed"], result
        # nginx and the replica both close the slow ones once their header timeout (10 s) passed
        closed = sum(
            n for answer, n in result["answers_to_slow_connections"].items() if answer != "refused"
        )
        assert closed >= 150, result
    for server in servers:
        assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
