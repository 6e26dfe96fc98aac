"""POST /synthesize, and the path every speech request takes, whichever endpoint it came in by.

Top to bottom: validation -> cache lookup -> engine (all segments of the text batched) ->
encoding -> response, the cache filled on the way back. Streamed responses send each chunk as
soon as the engine has decoded it; a client that leaves stops the generation.
"""

from __future__ import annotations

import logging
import math
import select
import socket
import time
from dataclasses import replace
from typing import Callable

import numpy as np
from flask import Blueprint, Response, current_app, g, request

from .. import validation
from ..audio import content_type, encode, to_pcm16, wav_header
from ..cache import cache_key
from ..engine import Cancelled, DeadlineExceeded, EngineError, NothingToSay, Overloaded
from ..errors import ApiError, ClientClosedRequest, GatewayTimeout, NotReady, Unprocessable
from .health import RETRY_AFTER_SECONDS

blueprint = Blueprint("synthesis", __name__)
log = logging.getLogger(__name__)


@blueprint.post("/synthesize")
def synthesize():
    return handle_speech(validation.synthesize_request)


def handle_speech(parse) -> Response:
    """Parse with ``parse(body, settings, voices)`` and answer with audio or an ApiError."""
    state = current_app.extensions["chattts"]
    metrics = state.metrics
    started = time.perf_counter()
    status = 500
    streaming = False
    state.recent.begin()
    try:
        if state.draining:
            metrics.rejected.labels(reason="draining").inc()
            raise NotReady("the server is shutting down", headers={"Retry-After": "1"})
        if not state.ready:
            raise NotReady(f"model is not ready ({state.phase})",
                           headers={"Retry-After": RETRY_AFTER_SECONDS})
        body = validation.json_body(request.mimetype, request.get_data(cache=False))
        synthesis_request, output = parse(body, state.settings, state.engine.voices)
        step_cap = None
        if state.degraded:  # cheaper settings while the CPU is saturated
            synthesis_request = replace(synthesis_request, refine_text=False, refine_prompt="")
            step_cap = state.settings.degraded_max_new_tokens
            g.degraded = True
        if output.stream:
            response = _stream(state, synthesis_request, output, started, step_cap)
            streaming = True
        else:
            response = _whole(state, synthesis_request, output, step_cap)
        status = 200
        return response
    except ApiError as error:
        status = error.status
        raise
    finally:
        if not streaming:  # a stream counts itself when it ends
            metrics.requests_total.labels(status=str(status)).inc()
            metrics.request_duration.observe(time.perf_counter() - started)
            state.recent.end(time.perf_counter() - started, g.get("audio_seconds", 0.0),
                             g.get("cache") if status == 200 else None)


def _headers(response: Response, cache_status: str, seconds: float | None, segments=None):
    response.headers["X-Cache"] = cache_status
    if seconds is not None:
        response.headers["X-Audio-Seconds"] = f"{seconds:.3f}"
    if segments is not None:
        response.headers["X-Segments"] = str(segments)
    response.headers["Cache-Control"] = "no-store"


def _whole(state, synthesis_request, output, step_cap=None) -> Response:
    metrics, identity = state.metrics, state.engine.identity
    key = cache_key(synthesis_request, identity, output.format)
    cached = state.cache.get(key)
    segments = None
    if cached is not None:
        body, seconds, cache_status = cached[0], cached[1], "HIT"
    else:
        pcm_key = cache_key(synthesis_request, identity, "pcm")
        pcm = state.cache.get(pcm_key)
        if pcm is not None:  # the same speech was made for another format: encode it again
            audio, seconds, cache_status = _from_pcm(pcm[0]), pcm[1], "HIT"
        else:
            result = _infer(state, synthesis_request, step_cap)
            audio, seconds, cache_status = result.audio, result.seconds, "MISS"
            segments = result.segments
            cacheable = _cacheable(step_cap, result.truncated)
            if cacheable:
                state.cache.put(pcm_key, (to_pcm16(audio), seconds))
        body = encode(audio, state.engine.sample_rate, output.format)
        if cache_status == "HIT" or cacheable:
            state.cache.put(key, (body, seconds))
    (metrics.cache_hits if cache_status == "HIT" else metrics.cache_misses).inc()
    metrics.audio_seconds.inc(seconds)
    g.audio_seconds, g.cache = seconds, cache_status
    response = Response(body, content_type=content_type(output.format, state.engine.sample_rate))
    _headers(response, cache_status, seconds, segments)
    return response


def _from_pcm(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0


def _cacheable(step_cap: int | None, truncated: int) -> bool:
    """A degraded answer (a lowered ``step_cap``) is what the request gets normally unless the
    lowered cap cut a segment short: only then is it kept out of the cache."""
    return step_cap is None or truncated == 0


def _stream(state, synthesis_request, output, started: float, step_cap=None) -> Response:
    metrics, engine = state.metrics, state.engine
    rate = engine.sample_rate
    pcm_key = cache_key(synthesis_request, engine.identity, "pcm")
    header = wav_header(rate, None) if output.format == "wav" else b""
    cached = state.cache.get(pcm_key)
    run = None
    if cached is None:
        # queue full etc. is still a JSON error here
        run = _start(state, synthesis_request, stream=True, step_cap=step_cap)
    should_stop = client_gone(request.environ)
    g.cache = cache_status = "HIT" if cached is not None else "MISS"

    began = []  # set once the server starts sending the body

    def generate():
        began.append(True)
        status, parts, seconds = 200, [], 0.0
        try:
            if cached is not None:
                metrics.cache_hits.inc()
                seconds = cached[1]
                yield header + cached[0]
                return
            metrics.cache_misses.inc()
            first = True
            try:
                for chunk in run.chunks(state.settings.request_timeout_s, should_stop):
                    pcm = to_pcm16(chunk)
                    parts.append(pcm)
                    seconds += len(chunk) / rate
                    if first:
                        metrics.first_audio.observe(time.perf_counter() - started)
                    yield (header + pcm) if first else pcm
                    first = False
            except (Cancelled, EngineError) as error:
                status = _outcome(metrics, error)
                log.warning("stream ended early: %s", error)
                # end the connection without the final chunk: the client sees a broken stream,
                # not a complete but short one
                raise StreamAborted(str(error)) from None
            metrics.infer_total.labels(outcome="ok").inc()
            metrics.infer_duration.observe(time.perf_counter() - started)
            if _cacheable(step_cap, run.truncated):
                state.cache.put(pcm_key, (b"".join(parts), seconds))
        except GeneratorExit:  # the client went away while we were sending
            status = 499
            if run is not None:
                run.cancel()
                metrics.infer_total.labels(outcome="cancelled").inc()
            raise
        finally:
            if run is not None:
                metrics.queue_depth.dec()
            metrics.audio_seconds.inc(seconds)
            metrics.requests_total.labels(status=str(status)).inc()
            metrics.request_duration.observe(time.perf_counter() - started)
            state.recent.end(time.perf_counter() - started, seconds,
                             cache_status if status == 200 else None)

    def never_sent():
        # the connection closed before the body was started: generate()'s clean-up never ran
        if began:
            return
        if run is not None:
            run.cancel()
            metrics.queue_depth.dec()
        state.recent.end(0.0, 0.0, None)
        metrics.requests_total.labels(status="499").inc()
        metrics.request_duration.observe(time.perf_counter() - started)

    response = Response(generate(), content_type=content_type(output.format, rate),
                        direct_passthrough=True)
    response.call_on_close(never_sent)
    _headers(response, g.cache, cached[1] if cached is not None else None)
    response.headers["X-Accel-Buffering"] = "no"  # a proxy in front must not hold chunks back
    return response


class StreamAborted(Exception):
    """A stream could not be finished; raised into the server so it drops the connection."""


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


def _start(state, synthesis_request, stream=True, step_cap=None):
    """Queue a request's segments; the queue depth gauge counts it until it is answered."""
    try:
        run = state.engine.start(synthesis_request, stream=stream, step_cap=step_cap)
    except NothingToSay as error:
        state.metrics.infer_total.labels(outcome="nothing_to_say").inc()
        raise Unprocessable(str(error)) from None
    except Overloaded as error:
        state.metrics.infer_total.labels(outcome="overloaded").inc()
        state.metrics.rejected.labels(reason=error.reason).inc()
        retry = str(max(1, min(300, math.ceil(error.retry_after))))
        raise NotReady(f"server is overloaded: {error}", headers={"Retry-After": retry}) from None
    except EngineError as error:
        state.metrics.infer_total.labels(outcome="error").inc()
        raise ApiError(f"synthesis failed: {error}", status=500) from None
    state.metrics.queue_depth.inc()
    return run


def _outcome(metrics, error: Exception) -> int:
    """Count a failed inference; the status it answers with."""
    if isinstance(error, DeadlineExceeded):
        metrics.infer_total.labels(outcome="timeout").inc()
        return 504
    if isinstance(error, Cancelled):
        metrics.infer_total.labels(outcome="cancelled").inc()
        return 499
    if isinstance(error, NothingToSay):
        metrics.infer_total.labels(outcome="nothing_to_say").inc()
        return 422
    metrics.infer_total.labels(outcome="error").inc()
    return 500


def _infer(state, synthesis_request, step_cap=None):
    metrics = state.metrics
    run = _start(state, synthesis_request, stream=False, step_cap=step_cap)
    started = time.perf_counter()
    try:
        result = run.result(state.settings.request_timeout_s, client_gone(request.environ))
    except (Cancelled, EngineError) as error:
        status = _outcome(metrics, error)
        if status == 504:
            raise GatewayTimeout(f"synthesis dropped: {error}") from None
        if status == 499:
            raise ClientClosedRequest(f"synthesis dropped: {error}") from None
        if status == 422:
            raise Unprocessable(str(error)) from None
        raise ApiError(f"synthesis failed: {error}", status=500) from None
    finally:
        metrics.queue_depth.dec()
    metrics.infer_total.labels(outcome="ok").inc()
    metrics.infer_duration.observe(time.perf_counter() - started)
    if result.truncated:
        metrics.segments_truncated.inc(result.truncated)
    return result
