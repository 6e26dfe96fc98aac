"""Slow and idle clients: the request framing on bytes, then a real server on loopback under
hundreds of idle, slow-header and slow-body connections, oversized requests and a client that
stops reading its answers."""

from __future__ import annotations

import json
import re
import resource
import socket
import threading
import time
from pathlib import Path

import pytest
import requests

from chattts_service.transport.intake import (
    MAX_BUFFERED_BYTES,
    MAX_HEAD_BYTES,
    MAX_REQUEST_LINE,
    MAX_WIRE_BODY_BYTES,
    Rejected,
    RequestBuffer,
)

POST_HEAD = b"POST /synthesize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def buffered(*chunks: bytes) -> RequestBuffer:
    buffer = RequestBuffer()
    for chunk in chunks:
        buffer.feed(chunk)
    return buffer


# -- framing --------------------------------------------------------------------------------


def test_a_request_is_whole_only_with_its_body():
    body = b'{"text": "hi"}'
    head = POST_HEAD + b"Content-Length: %d\r\n\r\n" % len(body)
    buffer = buffered(head, body[:5])
    assert buffer.examine() is None
    assert buffer.head.path == "/synthesize" and buffer.head.body_length == len(body)
    buffer.feed(body[5:])
    assert buffer.examine() == len(head) + len(body)


def test_pipelined_requests_are_taken_one_at_a_time():
    first = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    second = b"GET /readyz?x=1 HTTP/1.1\r\nHost: x\r\n\r\n"
    buffer = buffered(b"\r\n" + first + second[:10])
    end = buffer.examine()
    assert buffer.take(end) == first
    assert buffer.examine() is None
    buffer.feed(second[10:])
    assert buffer.examine() == len(second) and buffer.head.path == "/readyz"


def test_a_chunked_body_ends_after_its_last_chunk_and_trailers():
    head = POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    body = b"5\r\nhello\r\n3;ext=1\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"
    for cut in range(len(body)):
        assert buffered(head, body[:cut]).examine() is None, cut
    assert buffered(head, body + b"GET /").examine() == len(head) + len(body)


def test_framing_it_cannot_read_goes_to_the_parser_at_the_end_of_the_headers():
    for framing in (
        b"Content-Length: 1x\r\n",
        b"Content-Length: 2\r\nContent-Length: 3\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
    ):
        head = POST_HEAD + framing + b"\r\n"
        assert buffered(head).examine() == len(head)
    head = POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    assert buffered(head, b"zz\r\n").examine() == len(head) + 4  # a size that is not hex


def test_oversized_requests_are_refused_with_their_status():
    cases = {
        414: [b"GET /" + b"a" * MAX_REQUEST_LINE],
        431: [b"GET / HTTP/1.1\r\n" + b"X-Big: " + b"b" * MAX_HEAD_BYTES],
        413: [POST_HEAD + b"Content-Length: %d\r\n\r\n" % (MAX_WIRE_BODY_BYTES + 1)],
    }
    chunked = POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    cases[413 + 1000] = [chunked, b"%x\r\n" % (MAX_WIRE_BODY_BYTES + 1)]
    for status, chunks in cases.items():
        with pytest.raises(Rejected) as refused:
            buffered(*chunks).examine()
        assert refused.value.status == status % 1000


def test_expect_continue_is_noted_for_http11_only():
    head = POST_HEAD + b"Content-Length: 4\r\nExpect: 100-continue\r\n\r\n"
    buffer = buffered(head)
    assert buffer.examine() is None and buffer.head.expects_continue
    old = buffered(head.replace(b"HTTP/1.1", b"HTTP/1.0"))
    assert old.examine() is None and not old.head.expects_continue


# -- a real server under slow and idle clients ------------------------------------------------

IDLE, SLOW_HEADERS, SLOW_BODIES = 300, 300, 30
TIMEOUTS = {"IDLE": "2", "HEADER": "3", "BODY": "3", "SEND": "3"}


@pytest.fixture(scope="module")
def server(start_server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = IDLE + SLOW_HEADERS + SLOW_BODIES + 200
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    settings = {f"CHATTTS_HTTP_{name}_TIMEOUT_S": value for name, value in TIMEOUTS.items()}
    server = start_server(CHATTTS_HTTP_THREADS="4", **settings)
    server.wait_ready()
    return server


def worker_of(server) -> int:
    return server.pids()[1]


def usage(pid: int) -> dict[str, int]:
    proc = Path(f"/proc/{pid}")
    rss = next(
        int(line.split()[1])
        for line in (proc / "status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    return {
        "fds": len(list((proc / "fd").iterdir())),
        "threads": len(list((proc / "task").iterdir())),
        "rss_kb": rss,
    }


def metrics(server) -> dict[str, float]:
    values = {}
    for line in requests.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("chatts_http_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_answer(sock: socket.socket, seconds: float = 10) -> bytes:
    """What the server sends until it closes (b"" when it closes without a word)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def status_and_body(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_idle_and_slow_clients_leave_probes_and_speech_served(server):
    # warm every path first, so that what the flood leaves behind is measured against a
    # process that has already grown its threads and buffers
    for _ in range(3):
        requests.get(server.url + "/healthz", timeout=5)
        requests.post(server.url + "/synthesize", json={"text": "你好。"}, timeout=60)
    worker = worker_of(server)
    before = usage(worker)
    counted = metrics(server)

    idle = [connect(server) for _ in range(IDLE)]
    slow_headers = [connect(server) for _ in range(SLOW_HEADERS)]
    slow_bodies = [connect(server) for _ in range(SLOW_BODIES)]
    for sock in slow_headers:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    for sock in slow_bodies:
        sock.sendall(POST_HEAD + b'Content-Length: 40\r\n\r\n{"text": ')

    probe_seconds, speech = [], []
    started = time.monotonic()
    while time.monotonic() - started < 6:  # bounded: twice the header and body timeouts
        # a header line every half second, as a slowloris sends them, until just before the
        # header timeout (bytes sent after the server's 408 and close would reset the
        # connection, and a reset can discard the 408 before this test reads it)
        for sock in slow_headers if time.monotonic() - started < 2.5 else ():
            try:
                sock.send(b"X-Slow: 1\r\n")
            except OSError:
                pass
        began = time.monotonic()
        assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
        probe_seconds.append(time.monotonic() - began)
        answer = requests.post(server.url + "/synthesize", json={"text": "还在。"}, timeout=30)
        speech.append((answer.status_code, answer.headers.get("Content-Type")))
        time.sleep(0.5)

    assert max(probe_seconds) < 1.0, probe_seconds
    assert all(code == 200 and kind == "audio/wav" for code, kind in speech), speech

    # those that had begun a request get a 408 in the route's shape; idle ones are closed
    for sock in slow_headers[:5] + slow_bodies[:5]:
        status, body = status_and_body(read_answer(sock))
        assert status == 408 and "did not arrive within 3 s" in body["error"]
    assert read_answer(idle[0]) == b""
    for sock in idle + slow_headers + slow_bodies:
        sock.close()

    after_metrics = metrics(server)

    def grew(name: str) -> float:
        return after_metrics[name] - counted.get(name, 0.0)

    assert grew('chatts_http_timeouts_total{phase="idle"}') >= IDLE
    assert grew('chatts_http_timeouts_total{phase="header"}') == SLOW_HEADERS
    assert grew('chatts_http_timeouts_total{phase="body"}') == SLOW_BODIES
    assert after_metrics["chatts_http_buffered_bytes"] == 0

    # nothing left behind: descriptors, threads, and memory back to their level
    time.sleep(3)
    after = usage(worker)
    assert worker_of(server) == worker
    assert after["fds"] <= before["fds"] + 2, (before, after)
    assert after["threads"] <= before["threads"], (before, after)
    assert after["rss_kb"] < before["rss_kb"] + 30 * 1024, (before, after)


def test_oversized_and_cut_off_requests_get_a_4xx_and_the_worker_lives(server):
    worker = worker_of(server)
    cases = [
        (b"GET /" + b"a" * (MAX_REQUEST_LINE + 10) + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /healthz HTTP/1.1\r\nX-Huge: " + b"h" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n", 431),
        (
            b"POST /v1/audio/speech HTTP/1.1\r\nContent-Length: %d\r\n\r\n"
            % (MAX_WIRE_BODY_BYTES * 2),
            413,
        ),
    ]
    for request, expected in cases:
        sock = connect(server)
        try:
            sock.sendall(request)
        except OSError:
            pass  # the answer may come, and the connection close, while still sending
        status, body = status_and_body(read_answer(sock))
        sock.close()
        assert status == expected, body
        if expected == 413:  # a /v1/ path: OpenAI's error object
            assert body["error"]["type"] == "invalid_request_error"

    # a body that stops halfway: 408 once the body timeout has passed, in OpenAI's shape
    sock = connect(server)
    sock.sendall(
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 80\r\n\r\n{"model": "tts-1", '
    )
    began = time.monotonic()
    status, body = status_and_body(read_answer(sock))
    sock.close()
    assert status == 408 and body["error"]["type"] == "timeout"
    assert 2.5 < time.monotonic() - began < 8

    # a header the parser refuses on its own (over gunicorn's per-field limit) is still a 4xx
    sock = connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nX-Long: " + b"l" * 9000 + b"\r\n\r\n")
    answer = read_answer(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 4"), answer[:80]

    assert worker_of(server) == worker
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
    after = metrics(server)
    for status in (413, 414, 431):
        assert after[f'chatts_http_rejected_total{{status="{status}"}}'] >= 1


def test_expect_continue_gets_its_100_before_the_body(server):
    body = json.dumps({"text": "继续。"}).encode()
    sock = connect(server)
    sock.sendall(POST_HEAD + b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body))
    sock.settimeout(5)
    assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
    sock.sendall(body)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200 ") and b"100 Continue" not in answer


def test_chunked_and_pipelined_requests_are_answered_in_order(server):
    body = json.dumps({"text": "分块发送。", "seed": 8}).encode()

    def pieces():  # requests sends a generator's pieces with chunked transfer encoding
        for start in range(0, len(body), 7):
            yield body[start : start + 7]

    answer = requests.post(
        server.url + "/synthesize",
        data=pieces(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert answer.status_code == 200 and answer.content[:4] == b"RIFF"

    # three requests in one write, each answered on the same connection, in order
    sock = connect(server)
    sock.sendall(
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        + POST_HEAD
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
        + b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    answers = read_answer(sock, seconds=30)
    sock.close()
    # each answer's body runs straight into the next status line
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", answers)]
    assert statuses == [200, 200, 404], answers[:300]


def test_a_client_that_stops_reading_is_cut_off_and_probes_still_answer(server):
    """Pipelined requests for a 30 KB document, never read: the server's send buffer fills,
    its thread waits, and after the send timeout the connection is closed; probes answer
    throughout, from their own threads."""
    sent_before = metrics(server).get('chatts_http_timeouts_total{phase="send"}', 0.0)
    sock = connect(server)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
    stop = threading.Event()

    def pipeline():
        for _ in range(2000):  # bounded: ~60 MB of answers asked for, far beyond the buffers
            if stop.is_set():
                return
            try:
                sock.sendall(request)
            except OSError:
                return

    sender = threading.Thread(target=pipeline, daemon=True)
    sender.start()
    deadline = time.monotonic() + 15
    probes = []
    while time.monotonic() < deadline:
        began = time.monotonic()
        assert requests.get(server.url + "/readyz", timeout=5).status_code == 200
        probes.append(time.monotonic() - began)
        value = metrics(server).get('chatts_http_timeouts_total{phase="send"}', 0.0)
        if value > sent_before:
            break
        time.sleep(0.5)
    stop.set()
    sock.close()
    sender.join(timeout=10)
    assert value == sent_before + 1
    assert max(probes) < 1.0, probes


def test_at_the_connection_limit_the_longest_waiting_make_room(start_server):
    server = start_server(CHATTTS_HTTP_MAX_CONNECTIONS="40", CHATTTS_HTTP_IDLE_TIMEOUT_S="60")
    server.wait_ready()
    held = [connect(server) for _ in range(100)]
    began = time.monotonic()
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
    assert time.monotonic() - began < 1.0
    assert read_answer(held[0], seconds=5) == b""  # the oldest were closed
    for sock in held:
        sock.close()
    assert metrics(server)["chatts_http_evicted_total"] >= 60


def test_a_crowd_of_large_uploads_is_held_to_the_memory_budget(start_server):
    """Uploads of the largest body, all left one byte short: the bytes held stop at the
    budget and the uploads beyond it get 503 with Retry-After (a body timeout long enough
    that none times out first, however slowly this machine moves the bytes)."""
    server = start_server(CHATTTS_HTTP_BODY_TIMEOUT_S="300")
    server.wait_ready()
    size = MAX_WIRE_BODY_BYTES - 1024
    count = MAX_BUFFERED_BYTES // size + 2
    body = b"x" * (size - 1)
    uploads = []
    for _ in range(count):
        sock = connect(server)
        sock.sendall(POST_HEAD + b"Content-Length: %d\r\n\r\n" % size)
        uploads.append(sock)
    senders = [threading.Thread(target=_send_quietly, args=(sock, body)) for sock in uploads]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(timeout=120)
    answers = []
    for sock in uploads:
        sock.settimeout(2)
        try:
            head = sock.recv(4096).partition(b"\r\n\r\n")[0]
        except (TimeoutError, ConnectionResetError):
            head = b""  # still waiting for its last byte: held, not refused
        if head:
            answers.append((int(head.split(b" ", 2)[1]), b"Retry-After: 5" in head))
        sock.close()
    statuses = [status for status, _ in answers]
    assert statuses and set(statuses) == {503}, statuses
    assert all(retry for _, retry in answers)
    deadline = time.monotonic() + 10
    while metrics(server)["chatts_http_buffered_bytes"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metrics(server)["chatts_http_buffered_bytes"] == 0


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # refused half-way: the answer says why
