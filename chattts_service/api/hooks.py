"""What runs around every request: the API-key check, and the one-line access log."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flask import Flask, Response, g, request

from chattts_service.api.auth import ApiKeys
from chattts_service.api.errors import Unauthorized

log = logging.getLogger("chattts_service.access")

QUIET_PATHS = ("/healthz", "/readyz", "/metrics")  # probes and scrapes would drown the log


def require_api_key(
    app: Flask, api_keys: ApiKeys, metrics_auth: bool, on_refused: Callable[[], None]
) -> None:
    """With keys configured, every path but the open ones needs ``Authorization: Bearer``;
    ``on_refused()`` counts a refusal."""

    @app.before_request
    def check_api_key() -> None:
        needs_key = api_keys.enabled and not ApiKeys.is_open(request.path, metrics_auth)
        if needs_key and not api_keys.allows(request.headers.get("Authorization")):
            on_refused()
            raise Unauthorized(
                "a valid API key is required: Authorization: Bearer <key>",
                headers={"WWW-Authenticate": "Bearer"},
            )


def log_requests(app: Flask) -> None:
    """One line a request: method, path, status, duration, audio seconds, cache status."""

    @app.before_request
    def remember_start() -> None:
        g.started = time.perf_counter()

    @app.after_request
    def log_request(response: Response) -> Response:
        if g.get("degraded"):
            response.headers["X-Degraded"] = "1"
        if request.path in QUIET_PATHS:
            return response
        started = g.get("started", time.perf_counter())
        method, path, cache = request.method, request.path, g.get("cache", "-")
        stream = g.get("stream")
        if stream is not None and response.is_streamed:
            # written when the last byte has left (or the client has gone): the whole request

            def log_stream() -> None:
                status = stream.status or response.status_code
                seconds = stream.seconds or 0.0
                _line(method, path, status, time.perf_counter() - started, seconds, cache)

            response.call_on_close(log_stream)
            return response
        duration = time.perf_counter() - started
        _line(method, path, response.status_code, duration, g.get("audio_seconds", 0.0), cache)
        return response


def _line(
    method: str, path: str, status: int, duration: float, audio_seconds: float, cache: str
) -> None:
    log.info(
        "%s %s %d %.3fs audio=%.2fs cache=%s",
        method,
        path,
        status,
        duration,
        audio_seconds,
        cache,
    )
