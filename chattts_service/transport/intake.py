"""Request intake: a whole request is read off the wire before any thread is given to it.

gunicorn's threaded worker hands each connection to a thread that then blocks reading the
request; a few dozen clients that connect and send nothing, or send their headers a line a
second, hold every thread and the service stops answering, health checks included. Here the
worker's event loop reads each request into a buffer (non-blocking, with deadlines) and hands
it to a thread only once its line, headers and body have all arrived; a thread then parses it
from memory and never waits on the client's upload. Connections that idle, or whose request
does not arrive in time, are closed by the loop (408 where a request had begun), and at the
connection limit the one that has waited longest without a request in progress makes room
for a new one. Probes (``/healthz``, ``/readyz``, ``/metrics``) have threads of their own, so
not even a full set of long syntheses delays them.

``RequestBuffer`` is the framing alone (no sockets: tested on bytes); ``IntakeWorker`` is the
gunicorn worker around it. Longer than most modules: the worker overrides gunicorn's event
loop, and its deadlines, limits and hand-over read the framing's state at every turn.
"""

from __future__ import annotations

import errno
import json
import selectors
import socket
import time
from concurrent import futures
from dataclasses import dataclass, field

from gunicorn.http.message import Request
from gunicorn.http.parser import RequestParser
from gunicorn.workers.gthread import TConn, ThreadWorker

from chattts_service.api.errors import RETRY_AFTER_SECONDS, error_body

# Paths answered by their own threads: liveness, readiness and metrics stay prompt however
# many syntheses hold the request threads.
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
PROBE_THREADS = 2
MAX_REQUEST_LINE = 8190  # bytes, the request line alone (414 beyond; gunicorn's largest)
MAX_HEAD_BYTES = 64 * 1024  # the request line and all headers (431 beyond)
# the largest body read into memory (413 beyond): a voice sample's 10 MiB and its multipart
# framing; every JSON route sets its own, far lower, limit after this
MAX_WIRE_BODY_BYTES = 16 * 1024 * 1024
TOO_LARGE_BODY = f"request body over {MAX_WIRE_BODY_BYTES // (1024 * 1024)} MiB"
# request bytes held over all connections at once: a request arriving beyond it gets 503, so a
# crowd of large uploads cannot take the process's memory (16 uploads of the largest body)
MAX_BUFFERED_BYTES = 256 * 1024 * 1024
RECV_BYTES = 64 * 1024
LINGER_SECONDS = 2.0  # after an error answer: reading what the client still sends, then close
TIMEOUT_PHASES = ("idle", "header", "body", "send")
PARTS = {"header": "line and headers", "body": "body"}
REASONS = {
    408: "Request Timeout",
    413: "Content Too Large",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}
REFUSED = (413, 414, 431, 503)


@dataclass(frozen=True)
class IntakeLimits:
    """How long each part of a request may take to arrive, and how many connections stay
    open (the README's connection settings)."""

    idle_timeout: float = 5.0
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    send_timeout: float = 60.0
    max_connections: int = 1000

    @classmethod
    def from_settings(cls, settings) -> IntakeLimits:
        return cls(
            idle_timeout=settings.http_idle_timeout_s,
            header_timeout=settings.http_header_timeout_s,
            body_timeout=settings.http_body_timeout_s,
            send_timeout=settings.http_send_timeout_s,
            max_connections=settings.http_max_connections,
        )


class Rejected(Exception):
    """The request cannot be taken: answer ``status`` with ``message`` and close."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Head:
    method: str
    path: str
    http11: bool
    expects_continue: bool
    body_length: int | None  # None: chunked
    end: int  # offset of the body's first byte


class RequestBuffer:
    """The bytes of a connection's next request, and where that request ends.

    ``examine()`` says whether a whole request is here (its length), not yet (None), or
    cannot be taken (``Rejected``). Framing it cannot read with certainty (an invalid or
    repeated Content-Length, a Transfer-Encoding other than chunked) is handed on as soon as
    the headers are complete: gunicorn's parser then answers 400 from memory."""

    def __init__(self):
        self.data = bytearray()
        self.head: Head | None = None

    def __len__(self) -> int:
        return len(self.data)

    def feed(self, chunk: bytes) -> None:
        self.data += chunk

    def take(self, length: int) -> bytes:
        """The first request's bytes; what follows (a pipelined request) stays."""
        request = bytes(self.data[:length])
        del self.data[:length]
        self.head = None
        return request

    def examine(self) -> int | None:
        if self.head is None:
            # blank lines before a request line are allowed (RFC 9112, 2.2)
            start = 0
            while start < len(self.data) and self.data[start] in b"\r\n":
                start += 1
            if start:
                del self.data[:start]
            self.head = self._read_head()
            if self.head is None:
                return None
        head = self.head
        if head.body_length is not None:
            end = head.end + head.body_length
            return end if len(self.data) >= end else None
        return _chunked_end(self.data, head.end)

    def _read_head(self) -> Head | None:
        data = self.data
        line_end = data.find(b"\r\n", 0, MAX_REQUEST_LINE + 2)
        if line_end < 0:
            if len(data) > MAX_REQUEST_LINE:
                raise Rejected(414, f"request line longer than {MAX_REQUEST_LINE} bytes")
            return None
        end = data.find(b"\r\n\r\n", line_end, MAX_HEAD_BYTES + 4)
        if end < 0:
            if len(data) > MAX_HEAD_BYTES:
                raise Rejected(431, f"request headers longer than {MAX_HEAD_BYTES} bytes")
            return None
        request_line = bytes(data[:line_end]).decode("latin-1").split(" ")
        method = request_line[0]
        target = request_line[1] if len(request_line) > 1 else ""
        http11 = len(request_line) > 2 and request_line[2] == "HTTP/1.1"
        lengths: list[str] = []
        encodings: list[str] = []
        expects = False
        for line in bytes(data[line_end + 2 : end]).decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length":
                lengths.append(value)
            elif name == "transfer-encoding":
                encodings.extend(v.strip().lower() for v in value.split(","))
            elif name == "expect":
                expects = value.lower() == "100-continue"
        body_length: int | None = 0
        if encodings:
            # chunked last is the only framing read here; anything else is gunicorn's 400
            body_length = None if encodings[-1] == "chunked" and not lengths else 0
        elif len(lengths) == 1 and lengths[0].isdigit():
            body_length = int(lengths[0])
        if body_length is not None and body_length > MAX_WIRE_BODY_BYTES:
            raise Rejected(413, TOO_LARGE_BODY)
        path = target.split("?", 1)[0]
        return Head(method, path, http11, expects and http11, body_length, end + 4)


def _chunked_end(data: bytearray, start: int) -> int | None:
    """Where a chunked body that begins at ``start`` ends (after its trailers), or None while
    it has not all arrived. A malformed size ends it at once: the parser rejects it."""
    position, total = start, 0
    while True:
        line_end = data.find(b"\r\n", position, position + 1024)
        if line_end < 0:
            return None if len(data) - position <= 1024 else position
        size_text = bytes(data[position:line_end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            return line_end + 2
        total += size
        if total > MAX_WIRE_BODY_BYTES:
            raise Rejected(413, TOO_LARGE_BODY)
        position = line_end + 2
        if size == 0:
            break
        position += size + 2
        if len(data) < position:
            return None
    # trailers, then an empty line
    while True:
        line_end = data.find(b"\r\n", position)
        if line_end < 0:
            return None
        if line_end == position:
            return position + 2
        position = line_end + 2


def rejection(status: int, message: str, path: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, in the route's error shape."""
    body = json.dumps(error_body(message, status, path)).encode()
    retry = f"Retry-After: {RETRY_AFTER_SECONDS}\r\n" if status == 503 else ""
    return (
        f"HTTP/1.1 {status} {REASONS[status]}\r\n"
        f"Content-Type: application/json\r\n{retry}"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


class _BufferedRequest(Request):
    # the intake loop has answered "100 Continue" itself, before the body arrived
    _policy_expect_continue = False


class _BufferedParser(RequestParser):
    mesg_class = _BufferedRequest


@dataclass
class IntakeStats:
    """What the loop did with connections; read by ``/metrics`` (written by one thread)."""

    timeouts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIMEOUT_PHASES, 0))
    rejected: dict[int, int] = field(default_factory=lambda: dict.fromkeys(REFUSED, 0))
    evicted: int = 0
    waiting: int = 0  # open, no request in a thread: idle or still arriving
    in_threads: int = 0
    buffered: int = 0  # bytes of requests held, not yet in a thread


class IntakeConnection(TConn):
    """A connection and its request as it arrives."""

    def __init__(self, cfg, sock, client, server):
        super().__init__(cfg, sock, client, server)
        self.buffer = RequestBuffer()
        self.request = b""
        self.probe = False
        self.continued = False
        self.since = time.monotonic()
        self.deadline = 0.0
        self.phase = "idle"
        # the thread parses from memory: it never waits for data first
        self.data_ready = True

    def wait_idle(self, limits: IntakeLimits, now: float) -> None:
        self.since, self.phase, self.deadline = now, "idle", now + limits.idle_timeout


class IntakeWorker(ThreadWorker):
    """gunicorn's threaded worker whose event loop reads whole requests before a thread
    takes them (see the module's docstring). ``limits`` come from the app's settings."""

    limits = IntakeLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.waiting: dict[IntakeConnection, None] = {}  # no request in a thread
        self.lingering: dict[socket.socket, float] = {}
        self.buffered = 0  # bytes of requests held in connections' buffers
        self.stats = IntakeStats()
        self.probe_pool: futures.ThreadPoolExecutor | None = None

    def init_process(self):
        self.probe_pool = futures.ThreadPoolExecutor(
            max_workers=PROBE_THREADS, thread_name_prefix="probe"
        )
        super().init_process()

    # -- the event loop: accept, read, hand over, time out ------------------------------

    def accept(self, listener):
        for _ in range(64):  # a burst of connections, without starving the other events
            try:
                sock, client = listener.accept()
            except OSError as error:
                if error.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED):
                    return
                if error.errno in (errno.EMFILE, errno.ENFILE):
                    self._evict_oldest()
                    return
                raise
            full = len(self.waiting) + self.stats.in_threads >= self.limits.max_connections
            if full and not self._evict_oldest():
                sock.close()  # every connection has a request in a thread
                continue
            self.nr_conns += 1
            conn = IntakeConnection(self.cfg, sock, client, listener.getsockname())
            conn.wait_idle(self.limits, time.monotonic())
            self._wait_for_request(conn)

    def _wait_for_request(self, conn: IntakeConnection) -> None:
        self.waiting[conn] = None
        self.poller.register(conn.sock, selectors.EVENT_READ, lambda _: self._on_readable(conn))

    def _on_readable(self, conn: IntakeConnection) -> None:
        if conn not in self.waiting:  # closed by an earlier event of the same poll
            return
        try:
            chunk = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._forget(conn)
            self._close(conn)
            return
        conn.buffer.feed(chunk)
        self.buffered += len(chunk)
        if self.buffered > MAX_BUFFERED_BYTES:
            self._reject(conn, 503, "too many requests arriving at once; try again shortly")
            return
        self._advance(conn, time.monotonic())

    def _advance(self, conn: IntakeConnection, now: float) -> None:
        """Hand the request on if it is whole; else set the deadline of what is missing."""
        try:
            end = conn.buffer.examine()
        except Rejected as error:
            self._reject(conn, error.status, error.message)
            return
        head = conn.buffer.head
        if end is not None and head is not None:
            self._forget(conn)
            conn.request = conn.buffer.take(end)
            self.buffered -= end
            conn.probe = head.method in ("GET", "HEAD") and head.path in PROBE_PATHS
            self.enqueue_req(conn)
            return
        if head is None:
            if len(conn.buffer) and conn.phase == "idle":
                conn.phase, conn.deadline = "header", now + self.limits.header_timeout
        elif conn.phase != "body":
            conn.phase, conn.deadline = "body", now + self.limits.body_timeout
            if head.expects_continue and not conn.continued:
                conn.continued = True
                try:
                    conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
                except OSError:
                    pass

    def enqueue_req(self, conn):
        self.stats.in_threads += 1
        pool = self.probe_pool if conn.probe else self.tpool
        assert pool is not None  # made in init_process, before any connection
        done = pool.submit(self.handle, conn)
        done.add_done_callback(
            lambda result: self.method_queue.defer(self.finish_request, conn, result)
        )

    def handle(self, conn):
        """In a request thread: parse the buffered request and answer it."""
        if conn.parser is None:
            conn.initialized = True
            conn.parser = _BufferedParser(self.cfg, conn.sock, conn.client)
        conn.parser.unreader.unread(conn.request)
        conn.request = b""
        return super().handle(conn)

    def handle_request(self, req, conn):
        # an answer the client stops reading frees its thread after send_timeout
        conn.sock.settimeout(self.limits.send_timeout)
        try:
            return super().handle_request(req, conn)
        except TimeoutError:
            self.method_queue.defer(self._count_timeout, "send")
            self.log.info(
                "closed %s: it read none of its answer for %.0f s",
                conn.client,
                self.limits.send_timeout,
            )
            return False

    def finish_request(self, conn, fs):
        """Back on the loop: a kept-alive connection waits for its next request."""
        self.stats.in_threads -= 1
        keep = not fs.cancelled() and fs.exception() is None and fs.result() is True
        # bytes the parser holds beyond its request: it read past the framing checked here
        if not keep or not self.alive or conn.parser.unreader.buf.getvalue():
            self._close(conn)
            return
        try:
            conn.sock.setblocking(False)
        except OSError:
            self._close(conn)
            return
        now = time.monotonic()
        conn.continued = False
        conn.wait_idle(self.limits, now)
        self._wait_for_request(conn)
        if len(conn.buffer):  # a pipelined request came in behind the last one
            conn.phase, conn.deadline = "header", now + self.limits.header_timeout
            self._advance(conn, now)

    def _reject(self, conn: IntakeConnection, status: int, message: str) -> None:
        self._forget(conn)
        if status == 408:
            self._count_timeout(conn.phase)
        else:
            self.stats.rejected[status] += 1
        head = conn.buffer.head
        path = head.path if head is not None else _path_of(conn.buffer.data)
        self.log.info("answered %s %d: %s", conn.client, status, message)
        self._drop_buffer(conn)
        try:
            conn.sock.send(rejection(status, message, path))
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        # keep reading (and dropping) for a moment: closing with unread data would reset
        # the connection and could destroy the answer before the client reads it
        self.lingering[conn.sock] = time.monotonic() + LINGER_SECONDS
        self.poller.register(conn.sock, selectors.EVENT_READ, self._on_lingering)

    def _on_lingering(self, sock: socket.socket) -> None:
        if sock not in self.lingering:
            return
        try:
            if sock.recv(RECV_BYTES):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._end_linger(sock)

    def _end_linger(self, sock: socket.socket) -> None:
        del self.lingering[sock]
        self.poller.unregister(sock)
        self.nr_conns -= 1
        sock.close()

    def _count_timeout(self, phase: str) -> None:
        self.stats.timeouts[phase] += 1

    def _forget(self, conn: IntakeConnection) -> None:
        if conn in self.waiting:
            del self.waiting[conn]
            self.poller.unregister(conn.sock)

    def _close(self, conn: IntakeConnection) -> None:
        self._drop_buffer(conn)
        self.nr_conns -= 1
        conn.close()

    def _drop_buffer(self, conn: IntakeConnection) -> None:
        self.buffered -= len(conn.buffer)
        conn.buffer = RequestBuffer()

    def _evict_oldest(self) -> bool:
        """Close the connection that has waited longest without a request in a thread."""
        if not self.waiting:
            return False
        oldest = min(self.waiting, key=lambda conn: conn.since)
        self._forget(oldest)
        self._close(oldest)
        self.stats.evicted += 1
        return True

    def _expire(self, now: float) -> None:
        for conn in [conn for conn in self.waiting if conn.deadline <= now]:
            if conn.phase == "idle":
                self._forget(conn)
                self._close(conn)
                self._count_timeout("idle")
            else:
                seconds = (
                    self.limits.header_timeout
                    if conn.phase == "header"
                    else self.limits.body_timeout
                )
                part = PARTS[conn.phase]
                self._reject(conn, 408, f"the request's {part} did not arrive within {seconds:g} s")
        for sock in [sock for sock, deadline in self.lingering.items() if deadline <= now]:
            self._end_linger(sock)

    def run(self):
        self.poller.register(
            self.method_queue.fileno(), selectors.EVENT_READ, self.method_queue.run_callbacks
        )
        self.set_accept_enabled(True)
        while self.alive:
            self.notify()
            self.wait_for_and_dispatch_events(timeout=0.5)
            if not self.is_parent_alive():
                break
            self._expire(time.monotonic())
        # stopping: no new connections; connections without a request in a thread close now
        self.set_accept_enabled(False)
        for conn in list(self.waiting):
            self._forget(conn)
            self._close(conn)
        give_up = time.monotonic() + self.cfg.graceful_timeout
        while self.stats.in_threads > 0 and time.monotonic() < give_up:
            self.notify()
            self.wait_for_and_dispatch_events(timeout=0.5)
            self._expire(time.monotonic())
        for pool in (self.tpool, self.probe_pool):
            if pool is not None:
                pool.shutdown(wait=False)
        self.poller.close()
        self.method_queue.close()
        for listener in self.sockets:
            listener.close()

    def update_stats(self) -> IntakeStats:
        self.stats.waiting = len(self.waiting)
        self.stats.buffered = self.buffered
        return self.stats


def _path_of(data: bytearray) -> str:
    parts = bytes(data[:MAX_REQUEST_LINE]).split(b"\r\n", 1)[0].split(b" ")
    return parts[1].decode("latin-1").split("?", 1)[0] if len(parts) > 1 else ""
