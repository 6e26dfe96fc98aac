"""POST /synthesize: text in, WAV out.

The path of one request, top to bottom: validation -> cache lookup -> engine -> WAV encoding
-> response (and the cache filled on the way back).
"""

from __future__ import annotations

import select
import socket
import time
from typing import Callable

from flask import Blueprint, Response, current_app, g, request

from .. import validation
from ..audio import to_wav
from ..cache import cache_key
from ..engine import Cancelled, DeadlineExceeded, EngineError, NothingToSay, Overloaded
from ..errors import ApiError, ClientClosedRequest, GatewayTimeout, NotReady, Unprocessable
from .health import RETRY_AFTER_SECONDS

blueprint = Blueprint("synthesis", __name__)


@blueprint.post("/synthesize")
def synthesize():
    state = current_app.extensions["chattts"]
    metrics = state.metrics
    started = time.perf_counter()
    status = 500
    try:
        if not state.ready:
            raise NotReady(f"model is not ready ({state.phase})",
                           headers={"Retry-After": RETRY_AFTER_SECONDS})
        body = validation.json_body(request.mimetype, request.get_data(cache=False))
        synthesis_request = validation.synthesize_request(body, state.settings)

        key = cache_key(synthesis_request, state.engine.identity)
        cached = state.cache.get(key)
        if cached is not None:
            metrics.cache_hits.inc()
            wav, seconds, cache_status = cached[0], cached[1], "HIT"
        else:
            metrics.cache_misses.inc()
            wav, seconds = _infer(state, synthesis_request)
            state.cache.put(key, (wav, seconds))
            cache_status = "MISS"

        metrics.audio_seconds.inc(seconds)
        g.audio_seconds, g.cache = seconds, cache_status
        status = 200
        response = Response(wav, mimetype="audio/wav")
        response.headers["X-Cache"] = cache_status
        response.headers["X-Audio-Seconds"] = f"{seconds:.3f}"
        return response
    except ApiError as error:
        status = error.status
        raise
    finally:
        metrics.requests_total.labels(status=str(status)).inc()
        metrics.request_duration.observe(time.perf_counter() - started)


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


def _infer(state, synthesis_request):
    metrics = state.metrics
    metrics.queue_depth.inc()
    started = time.perf_counter()
    try:
        result = state.engine.synthesize(synthesis_request,
                                         timeout=state.settings.request_timeout_s,
                                         should_stop=client_gone(request.environ))
    except DeadlineExceeded as error:
        metrics.infer_total.labels(outcome="timeout").inc()
        raise GatewayTimeout(f"synthesis dropped: {error}") from None
    except Cancelled as error:
        metrics.infer_total.labels(outcome="cancelled").inc()
        raise ClientClosedRequest(f"synthesis dropped: {error}") from None
    except NothingToSay as error:
        metrics.infer_total.labels(outcome="nothing_to_say").inc()
        raise Unprocessable(str(error)) from None
    except Overloaded as error:
        metrics.infer_total.labels(outcome="overloaded").inc()
        raise NotReady(f"server is overloaded: {error}",
                       headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
    except EngineError as error:
        metrics.infer_total.labels(outcome="error").inc()
        raise ApiError(f"synthesis failed: {error}", status=500) from None
    finally:
        metrics.queue_depth.dec()
    metrics.infer_total.labels(outcome="ok").inc()
    metrics.infer_duration.observe(time.perf_counter() - started)
    return to_wav(result.audio, result.sample_rate), result.seconds
