"""The HTTP side of a speech request, shared by ``/synthesize`` and ``/v1/audio/speech``.

Top to bottom: readiness -> body -> validation (the endpoint's own parser) -> the speech
pipeline (cache, engine, encoding; ``services.speech``) -> response. Streamed responses send
each chunk as soon as the engine has decoded it; a client that leaves stops the generation.
"""

from __future__ import annotations

import base64
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flask import Response, g, request

from chattts_service.api import validation
from chattts_service.api.answers import CaptionedSpeech as CaptionedAnswer
from chattts_service.api.answers import SpeechAudioDelta, SpeechAudioDone, Usage
from chattts_service.api.context import api_keys, service
from chattts_service.api.errors import BadRequest, NotReady, from_engine_error, status_of
from chattts_service.api.validation import Voices
from chattts_service.config import Settings
from chattts_service.domain.speech import (
    PRIORITIES,
    SAMPLE_RATE,
    SAMPLES_PER_STEP,
    EngineError,
    SynthesisRequest,
)
from chattts_service.runtime.metrics import Metrics
from chattts_service.services import captions
from chattts_service.services.service import RecentRequests
from chattts_service.services.speech import CaptionedSpeech, Output, Speech, SpeechStream

# an endpoint's parser: (JSON body, settings, voices) -> the request and how to answer it
Parser = Callable[[dict[str, Any], Settings, Voices | None], tuple[SynthesisRequest, Output]]


class RequestRecord:
    """One speech request in the metrics and the status page's recent list: begun when it
    arrives, finished exactly once with its HTTP status, however and wherever it ends (a
    stream: when the pipeline reports its end, mapped by the one table in ``errors``)."""

    def __init__(self, metrics: Metrics, recent: RecentRequests):
        self._metrics, self._recent = metrics, recent
        self.started = time.perf_counter()
        self._finished = False
        self._lock = threading.Lock()
        recent.begin()

    def finish(self, status: int, audio_seconds: float = 0.0, cache: str | None = None) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        elapsed = time.perf_counter() - self.started
        self._metrics.requests_total.labels(status=str(status)).inc()
        self._metrics.request_duration.observe(elapsed)
        self._recent.end(elapsed, audio_seconds, cache if status == 200 else None)


def speak(parse: Parser) -> Response:
    """Parse with ``parse(body, settings, voices)`` and answer with audio, or raise an error
    the error tables answer."""
    state = service()
    pipeline = state.speech
    record = RequestRecord(state.metrics, state.recent)
    try:
        if state.draining:
            state.metrics.rejected.labels(reason="draining").inc()
            raise NotReady("the server is shutting down")
        phase = state.serving_phase  # read once: the refusal names what decided it
        if phase != "ready":
            raise NotReady(f"model is not ready ({phase})")
        body = validation.json_body(request.mimetype, request.get_data(cache=False))
        synthesis_request, output = parse(body, state.settings, state.voices)
        # accepted, so not refused: ChatTTS cannot follow them, and the answer will say so
        g.instructions_ignored = bool(body.get("instructions"))
        plan = pipeline.plan(
            synthesis_request,
            degraded=state.degraded,
            priority=output.priority or _header_priority(),
            tenant=api_keys().name(request.headers.get("Authorization")),
        )
        g.degraded = plan.degraded
        should_stop = client_gone(request.environ)
        if output.stream:

            def ended(error: EngineError | None, seconds: float, cache: str) -> None:
                stream.status = 200 if error is None else from_engine_error(error).status
                record.finish(stream.status, seconds, cache)

            stream = pipeline.stream(plan, output, record.started, ended, should_stop)
            tokens = pipeline.input_tokens(plan) if output.events else 0
            return _streamed(stream, events=output.events, input_tokens=tokens)
        if output.captions:
            captioned = pipeline.captioned(plan, output, should_stop)
            record.finish(200, captioned.seconds, captioned.cache)
            return _captioned(captioned, output)
        speech = pipeline.synthesize(plan, output, should_stop)
        record.finish(200, speech.seconds, speech.cache)
        tokens = pipeline.input_tokens(plan) if output.events else 0
        return _whole(speech, events=output.events, input_tokens=tokens)
    except BaseException as error:  # answered by the error tables: counted with their status
        record.finish(status_of(error))
        raise


def _header_priority() -> str | None:
    """``X-Priority: interactive|bulk`` (for clients that cannot add a body field, such as
    OpenAI's); the body's ``priority`` wins."""
    asked = request.headers.get(PRIORITY_HEADER)
    if asked is None:
        return None
    asked = asked.strip().lower()
    if asked not in PRIORITIES:
        raise BadRequest(
            f"{PRIORITY_HEADER} must be one of {', '.join(PRIORITIES)}, not {asked[:40]!r}"
        )
    return asked


PRIORITY_HEADER = "X-Priority"


def _headers(
    response: Response, cache_status: str, seconds: float | None, segments: int | None = None
) -> None:
    if g.get("instructions_ignored"):
        response.headers["X-Instructions"] = "ignored"
        service().metrics.instructions_ignored.inc()
    response.headers["X-Cache"] = cache_status
    if seconds is not None:
        response.headers["X-Audio-Seconds"] = f"{seconds:.3f}"
    if segments is not None:
        response.headers["X-Segments"] = str(segments)
    response.headers["Cache-Control"] = "no-store"


def _whole(speech: Speech, events: bool = False, input_tokens: int = 0) -> Response:
    g.audio_seconds, g.cache = speech.seconds, speech.cache
    if events:  # a format that cannot stream: the whole file in one delta
        response = Response(
            _events([speech.body], lambda: speech.seconds, input_tokens),
            content_type=EVENT_STREAM,
        )
    else:
        response = Response(speech.body, content_type=speech.content_type)
    _headers(response, speech.cache, speech.seconds, speech.segments)
    return response


def _captioned(speech: CaptionedSpeech, output: Output) -> Response:
    """The audio (base64) and its captions in one JSON answer; SubRip or WebVTT as well
    when the request's ``caption_format`` asks for them."""
    g.audio_seconds, g.cache = speech.seconds, speech.cache
    answer = CaptionedAnswer(
        audio=base64.b64encode(speech.audio).decode("ascii"),
        format=output.format,
        content_type=speech.content_type,
        seconds=round(speech.seconds, 6),
        captions=[caption.describe() for caption in speech.captions],
        srt=captions.srt(speech.captions) if output.captions == "srt" else None,
        vtt=captions.vtt(speech.captions) if output.captions == "vtt" else None,
    )
    response = Response(answer.model_dump_json(exclude_none=True), content_type="application/json")
    _headers(response, speech.cache, speech.seconds, speech.segments)
    return response


def _streamed(stream: SpeechStream, events: bool = False, input_tokens: int = 0) -> Response:
    g.cache, g.stream = stream.cache, stream  # the access log waits for its end
    began = []  # set once the server starts sending the body

    def body() -> Iterator[bytes]:
        began.append(True)
        # a broken stream raises: the connection ends without its final chunk (or, with
        # events, without speech.audio.done), so the client sees a broken stream, not a
        # complete but short one
        if events:
            yield from _events(stream.chunks, lambda: stream.seconds or 0.0, input_tokens)
        else:
            yield from stream.chunks

    def never_sent() -> None:
        # the connection closed before the body was started: the stream's clean-up never ran
        if not began:
            stream.close_unsent()

    content_type = EVENT_STREAM if events else stream.content_type
    # not direct_passthrough: Werkzeug then hands the server the bare generator, and the
    # callbacks below (the unsent stream's clean-up, the access log) would never run
    response = Response(body(), content_type=content_type)
    response.call_on_close(never_sent)
    _headers(response, stream.cache, stream.seconds)
    response.headers["X-Accel-Buffering"] = "no"  # a proxy in front must not hold chunks back
    return response


EVENT_STREAM = "text/event-stream"


def _events(
    chunks: Iterable[bytes], seconds: Callable[[], float], input_tokens: int
) -> Iterator[bytes]:
    """Audio as OpenAI's speech events: ``speech.audio.delta`` with base64 audio, then
    ``speech.audio.done`` with usage: ``input_tokens`` the text tokens the model read,
    ``output_tokens`` the GPT steps' worth of audio (512 samples each). ``seconds()`` is
    the audio's length, asked once every chunk is out (an encoded chunk's size says nothing
    of its samples)."""
    for chunk in chunks:
        delta = SpeechAudioDelta(audio=base64.b64encode(chunk).decode("ascii"))
        yield f"data: {delta.model_dump_json()}\n\n".encode()
    steps = -(-round(seconds() * SAMPLE_RATE) // SAMPLES_PER_STEP)
    usage = Usage(input_tokens=input_tokens, output_tokens=steps, total_tokens=input_tokens + steps)
    yield f"data: {SpeechAudioDone(usage=usage).model_dump_json()}\n\n".encode()


def client_gone(environ: dict[str, Any]) -> Callable[[], bool] | None:
    """A check that the client closed its connection, so its request can be dropped."""
    connection = environ.get("gunicorn.socket")
    if connection is None:
        return None

    def gone() -> bool:
        try:
            # poll, not select: select fails on descriptors above 1023, which a server
            # holding hundreds of connections hands out
            poller = select.poll()
            poller.register(connection, select.POLLIN)
            if not poller.poll(0):
                return False
            peeked: bytes = connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return peeked == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (OSError, ValueError):
            return True

    return gone
