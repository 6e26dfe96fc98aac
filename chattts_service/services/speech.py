"""The speech pipeline both endpoints call: cache lookup -> engine -> encoding.

No HTTP here. The API layer parses and validates a request, then asks ``SpeechPipeline`` for
the whole answer (``synthesize``) or a stream (``stream``); engine errors come back as the
engine's typed errors, which ``api.errors`` maps to statuses. A stream reports how it ended
(``on_end``: None, or the engine error that ended it) when it does, which may be long after
its first bytes; the API counts the request then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from chattts_service.config import Settings
from chattts_service.domain.playback import Playback
from chattts_service.domain.speech import (
    INTERACTIVE,
    SAMPLES_PER_STEP,
    Cancelled,
    EngineError,
    Overloaded,
    Synthesis,
    SynthesisRequest,
)
from chattts_service.inference.engine import Engine
from chattts_service.inference.run import Run
from chattts_service.runtime.metrics import Metrics
from chattts_service.services.audio import (
    StreamWriter,
    content_type,
    encode,
    stream_writer,
    to_pcm16,
)
from chattts_service.services.cache import AudioCache, cache_key
from chattts_service.services.captions import Caption, captions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Output:
    format: str
    stream: bool
    events: bool = False  # Server-Sent Events (OpenAI's stream_format "sse"), else raw audio
    captions: str | None = None  # json, srt or vtt: the audio comes in JSON with its captions
    priority: str | None = None  # as the request asked (``fairness``); None: by its shape
    # a stream nobody asked for (OpenAI's endpoint streams by default): chunks as it generates
    # unless CHATTTS_DEFAULT_STREAM=segments (each segment's audio when it is decoded whole)
    by_default: bool = False


@dataclass(frozen=True)
class Plan:
    """What will actually be made: degraded mode drops refinement and lowers the step cap."""

    request: SynthesisRequest
    step_cap: int | None = None
    # its place in the scheduler's shares: ``interactive``, ``bulk`` or None (by its shape),
    # and its API key's name (None without keys)
    priority: str | None = None
    tenant: str | None = None

    @property
    def degraded(self) -> bool:
        return self.step_cap is not None


@dataclass(frozen=True)
class Speech:
    body: bytes
    content_type: str
    cache: str  # HIT or MISS
    seconds: float
    segments: int | None  # known when the model made it now


@dataclass(frozen=True)
class CaptionedSpeech:
    audio: bytes  # in the requested format
    content_type: str
    cache: str
    seconds: float
    captions: tuple[Caption, ...]
    segments: int


class SpeechStream:
    """A streamed answer: ``chunks`` yields the body; ``close_unsent`` releases a stream whose
    body was never started (the client left before the first byte). ``seconds`` is the audio's
    length: known at once from the cache, else once ``chunks`` is exhausted."""

    def __init__(
        self,
        chunks: Iterator[bytes],
        content_type: str,
        cache: str,
        seconds: float | None,
        close_unsent: Callable[[], None],
    ):
        self.chunks, self.content_type, self.cache = chunks, content_type, cache
        self.seconds, self.close_unsent = seconds, close_unsent
        self.status: int | None = None  # the API's status for how it ended, once it has


class StreamBroken(Exception):
    """A stream could not be finished after its first bytes were sent."""

    def __init__(self, error: EngineError):
        super().__init__(str(error))
        self.error = error


# how a stream ended: None when whole, else the engine error that ended it (Cancelled when
# its client went away); with the audio seconds sent and the cache status
StreamEnd = Callable[[EngineError | None, float, str], None]


class SpeechPipeline:
    def __init__(self, settings: Settings, engine: Engine, cache: AudioCache, metrics: Metrics):
        self.settings, self.engine, self.cache, self.metrics = settings, engine, cache, metrics

    def plan(
        self,
        request: SynthesisRequest,
        degraded: bool,
        priority: str | None = None,
        tenant: str | None = None,
    ) -> Plan:
        if not degraded:
            return Plan(request, priority=priority, tenant=tenant)
        return Plan(
            replace(request, refine_text=False, refine_prompt=""),
            self.settings.degraded_max_new_tokens,
            priority,
            tenant,
        )

    def input_tokens(self, plan: Plan) -> int:
        """The text tokens the model read for it: OpenAI's ``usage.input_tokens``."""
        try:
            return self.engine.input_tokens(plan.request)
        except EngineError:  # it was spoken, so this cannot happen; usage is no reason to fail
            return 0

    # -- whole answers -------------------------------------------------------------------------

    def synthesize(
        self, plan: Plan, output: Output, should_stop: Callable[[], bool] | None
    ) -> Speech:
        """The whole answer, from the cache when it holds it (in this format, or as PCM to
        encode again), else from the engine; filled on the way back unless degraded mode cut
        a segment short."""
        identity, rate = self.engine.identity, self.engine.sample_rate
        key = cache_key(plan.request, identity, output.format)
        cached = self.cache.get(key)
        segments = None
        if cached is not None:
            body, seconds, cache_status = cached[0], cached[1], "HIT"
        else:
            pcm_key = cache_key(plan.request, identity, "pcm")
            pcm = self.cache.get(pcm_key)
            if pcm is not None:  # the same speech was made for another format: encode it again
                audio, seconds, cache_status = from_pcm16(pcm[0]), pcm[1], "HIT"
            else:
                result = self._infer(plan, should_stop)
                audio, seconds, cache_status = result.audio, result.seconds, "MISS"
                segments = result.segments
                cacheable = _cacheable(plan, result.truncated)
                if cacheable:
                    self.cache.put(pcm_key, (to_pcm16(audio), seconds))
            body = encode(audio, rate, output.format)
            if cache_status == "HIT" or cacheable:
                self.cache.put(key, (body, seconds))
        self._count_served(cache_status, seconds)
        return Speech(body, content_type(output.format, rate), cache_status, seconds, segments)

    def captioned(
        self, plan: Plan, output: Output, should_stop: Callable[[], bool] | None
    ) -> CaptionedSpeech:
        """The whole answer with a caption per sentence (``plan.request`` reads each sentence
        as its own segment); cached with its captions, as they are one answer."""
        identity, rate = self.engine.identity, self.engine.sample_rate
        key = cache_key(plan.request, identity, f"captioned/{output.format}")
        cached = self.cache.get(key)
        if cached is not None:
            body, seconds, items, segments = cached
            cache_status = "HIT"
        else:
            run = self._start(plan, stream=False)
            result = self._finish(run, should_stop)
            items = tuple(
                captions(
                    run.sentences,
                    result.part_samples,
                    result.part_texts,
                    result.pause_samples,
                    rate,
                )
            )
            body = encode(result.audio, rate, output.format)
            seconds, segments, cache_status = result.seconds, result.segments, "MISS"
            if _cacheable(plan, result.truncated):
                self.cache.put(key, (body, seconds, items, segments))
        self._count_served(cache_status, seconds)
        return CaptionedSpeech(
            body, content_type(output.format, rate), cache_status, seconds, items, segments
        )

    def _infer(self, plan: Plan, should_stop: Callable[[], bool] | None) -> Synthesis:
        return self._finish(self._start(plan, stream=False), should_stop)

    def _finish(self, run: Run, should_stop: Callable[[], bool] | None) -> Synthesis:
        started = time.perf_counter()
        try:
            result = run.result(self.settings.request_timeout_s, should_stop)
        except EngineError as error:
            self._count_failure(error)
            raise
        finally:
            self.metrics.queue_depth.dec()
        self.metrics.infer_total.labels(outcome="ok").inc()
        self.metrics.infer_duration.observe(time.perf_counter() - started)
        if result.truncated:
            self.metrics.segments_truncated.inc(result.truncated)
        return result

    # -- streams -------------------------------------------------------------------------------

    def stream(
        self,
        plan: Plan,
        output: Output,
        started: float,
        on_end: StreamEnd,
        should_stop: Callable[[], bool] | None,
    ) -> SpeechStream:
        """Audio as it is decoded, in ``output.format`` (WAV with an open-ended header, PCM, or
        MP3, Opus and AAC encoded chunk by chunk). Queueing errors raise here, before any
        byte; later failures break the stream (``StreamBroken``)."""
        metrics, rate = self.metrics, self.engine.sample_rate
        pcm_key = cache_key(plan.request, self.engine.identity, "pcm")
        writer = stream_writer(output.format, rate)
        cached = self.cache.get(pcm_key)
        run = (
            None
            if cached is not None
            else self._start(
                plan,
                stream=True,
                early=not (output.by_default and self.settings.default_stream == "segments"),
            )
        )
        cache_status = "HIT" if cached is not None else "MISS"

        def chunks() -> Iterator[bytes]:
            outcome: EngineError | None = None
            parts: list[bytes] = []
            seconds = 0.0
            try:
                if cached is not None:
                    seconds = cached[1]
                    self._count_served("HIT", 0.0)
                    yield writer.encode(cached[0]) + writer.finish()
                    return
                self._count_served("MISS", 0.0)
                assert run is not None  # started: nothing was cached
                yield from self._stream_run(run, plan, writer, parts, started, should_stop)
                seconds = sum(len(part) for part in parts) / 2 / rate
                # a start decoded with a look-ahead is close to the whole answer, not it
                if run.provisional:
                    metrics.provisional_audio.inc(run.provisional * SAMPLES_PER_STEP / rate)
                elif _cacheable(plan, run.truncated):
                    self.cache.put(pcm_key, (b"".join(parts), seconds))
            except StreamBroken as broken:
                outcome = broken.error
                raise
            except GeneratorExit:  # the client went away while we were sending
                outcome = Cancelled("the client went away")
                if run is not None:
                    run.cancel()
                    metrics.infer_total.labels(outcome="cancelled").inc()
                raise
            finally:
                if run is not None:
                    metrics.queue_depth.dec()
                    seconds = seconds or sum(len(part) for part in parts) / 2 / rate
                metrics.audio_seconds.inc(seconds)
                speech.seconds = seconds
                on_end(outcome, seconds, cache_status)

        def close_unsent() -> None:
            if run is not None:
                run.cancel()
                metrics.queue_depth.dec()
            on_end(Cancelled("the client went away before the first byte"), 0.0, cache_status)

        speech = SpeechStream(
            chunks(),
            content_type(output.format, rate),
            cache_status,
            cached[1] if cached is not None else None,
            close_unsent,
        )
        return speech

    def _stream_run(
        self,
        run: Run,
        plan: Plan,
        writer: StreamWriter,
        parts: list[bytes],
        started: float,
        should_stop: Callable[[], bool] | None,
    ) -> Iterator[bytes]:
        playback = Playback()  # a listener playing from the first chunk handed over
        try:
            for chunk in run.chunks(self.settings.request_timeout_s, should_stop):
                pcm = to_pcm16(chunk)
                parts.append(pcm)
                now = time.perf_counter()
                if playback.first is None:
                    self.metrics.first_audio.labels(priority=plan.priority or INTERACTIVE).observe(
                        now - started
                    )
                playback.arrived(now, len(chunk) / self.engine.sample_rate)
                data = writer.encode(pcm)
                if data:  # an encoder may hold a chunk until it has a whole frame
                    yield data
        except EngineError as error:
            self._count_failure(error)
            log.warning("stream ended early: %s", error)
            raise StreamBroken(error) from None
        tail = writer.finish()
        if tail:
            yield tail
        self.metrics.infer_total.labels(outcome="ok").inc()
        self.metrics.infer_duration.observe(time.perf_counter() - started)
        if playback.first is not None:
            self.metrics.stream_behind.observe(playback.behind)

    # -- shared --------------------------------------------------------------------------------

    def _start(self, plan: Plan, stream: bool, early: bool = True) -> Run:
        """Queue a request's segments; the queue depth gauge counts it until it is answered."""
        try:
            run = self.engine.start(
                plan.request,
                stream=stream,
                step_cap=plan.step_cap,
                priority=plan.priority,
                tenant=plan.tenant,
                early=early,
            )
        except EngineError as error:
            self._count_failure(error)
            raise
        self.metrics.queue_depth.inc()
        return run

    def _count_failure(self, error: EngineError) -> None:
        self.metrics.infer_total.labels(outcome=error.outcome).inc()
        if isinstance(error, Overloaded):
            self.metrics.rejected.labels(reason=error.reason).inc()

    def _count_served(self, cache_status: str, seconds: float) -> None:
        (self.metrics.cache_hits if cache_status == "HIT" else self.metrics.cache_misses).inc()
        if seconds:
            self.metrics.audio_seconds.inc(seconds)


def from_pcm16(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0


def _cacheable(plan: Plan, truncated: int) -> bool:
    """A degraded answer (a lowered step cap) is what the request gets normally unless the
    lowered cap cut a segment short: only then is it kept out of the cache."""
    return not plan.degraded or truncated == 0
