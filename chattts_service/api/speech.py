"""The HTTP side of a speech request, shared by ``/synthesize`` and ``/v1/audio/speech``.

Top to bottom: readiness -> body -> validation (the endpoint's own parser) -> the speech
pipeline (cache, engine, encoding; ``services.speech``) -> response. Streamed responses send
each chunk as soon as the engine has decoded it; a client that leaves stops the generation.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable

from flask import Response, current_app, g, request

from chattts_service.api import validation
from chattts_service.api.errors import RETRY_AFTER_SECONDS, ApiError, NotReady, from_engine_error
from chattts_service.inference.types import EngineError
from chattts_service.services.speech import Speech, SpeechStream


def speak(parse) -> Response:
    """Parse with ``parse(body, settings, voices)`` and answer with audio or an ApiError."""
    state = current_app.extensions["chattts"]
    pipeline = state.speech
    record = pipeline.record()
    try:
        if state.draining:
            state.metrics.rejected.labels(reason="draining").inc()
            raise NotReady("the server is shutting down", headers={"Retry-After": "1"})
        if not state.ready:
            raise NotReady(
                f"model is not ready ({state.phase})", headers={"Retry-After": RETRY_AFTER_SECONDS}
            )
        body = validation.json_body(request.mimetype, request.get_data(cache=False))
        synthesis_request, output = parse(body, state.settings, state.engine.voices)
        plan = pipeline.plan(synthesis_request, degraded=state.degraded)
        g.degraded = plan.degraded
        should_stop = client_gone(request.environ)
        try:
            if output.stream:
                return _streamed(pipeline.stream(plan, output, record, should_stop))
            speech = pipeline.synthesize(plan, output, should_stop)
        except EngineError as error:
            raise from_engine_error(error) from None
        record.finish(200, speech.seconds, speech.cache)
        return _whole(speech)
    except ApiError as error:
        record.finish(error.status)
        raise
    except BaseException:
        record.finish(500)
        raise


def _headers(response: Response, cache_status: str, seconds: float | None, segments=None):
    response.headers["X-Cache"] = cache_status
    if seconds is not None:
        response.headers["X-Audio-Seconds"] = f"{seconds:.3f}"
    if segments is not None:
        response.headers["X-Segments"] = str(segments)
    response.headers["Cache-Control"] = "no-store"


def _whole(speech: Speech) -> Response:
    g.audio_seconds, g.cache = speech.seconds, speech.cache
    response = Response(speech.body, content_type=speech.content_type)
    _headers(response, speech.cache, speech.seconds, speech.segments)
    return response


def _streamed(stream: SpeechStream) -> Response:
    g.cache = stream.cache
    began = []  # set once the server starts sending the body

    def body():
        began.append(True)
        yield from stream.chunks  # a broken stream raises: the connection ends without its
        # final chunk, so the client sees a broken stream, not a complete but short one

    def never_sent():
        # the connection closed before the body was started: the stream's clean-up never ran
        if not began:
            stream.close_unsent()

    response = Response(body(), content_type=stream.content_type, direct_passthrough=True)
    response.call_on_close(never_sent)
    _headers(response, stream.cache, stream.seconds)
    response.headers["X-Accel-Buffering"] = "no"  # a proxy in front must not hold chunks back
    return response


def client_gone(environ) -> Callable[[], bool] | None:
    """A check that the client closed its connection, so its request can be dropped."""
    connection = environ.get("gunicorn.socket")
    if connection is None:
        return None

    def gone() -> bool:
        try:
            readable, _, _ = select.select([connection], [], [], 0)
            if not readable:
                return False
            return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            return True

    return gone
