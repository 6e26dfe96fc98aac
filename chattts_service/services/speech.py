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
    output_rate,
    stream_writer,
    to_pcm16,
)
from chattts_service.services.cache import AudioCache, cache_key
from chattts_service.services.captions import Caption, at_rate, captions, shifted

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
    sample_rate: int | None = None  # as asked; None: the format's own (``audio.output_rate``)

    def rate(self, model_rate: int) -> int:
        return output_rate(self.format, self.sample_rate, model_rate)

    def cache_format(self, model_rate: int) -> str:
        """The format and rate, as the cache keys an encoded answer."""
        return f"{self.format}@{self.rate(model_rate)}"


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


@dataclass
class _Span:
    """A span of a request being answered: the silence before it (samples), its PCM key in
    the cache, and its audio from the cache, or the run generating it (None once answered)."""

    request: SynthesisRequest
    gap: int
    pcm_key: str
    pcm: bytes | None = None
    run: Run | None = None


@dataclass(frozen=True)
class Made:
    """A whole answer made: its audio, the segments generated for it (0: every span from the
    cache), how many its step cap stopped, and its captions where asked."""

    audio: np.ndarray
    segments: int
    truncated: int
    captions: tuple[Caption, ...] = ()


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
            request.each_span(refine_text=False, refine_prompt=""),
            self.settings.degraded_max_new_tokens,
            priority,
            tenant,
        )

    def input_tokens(self, plan: Plan) -> int:
        """The text tokens the model read for it: OpenAI's ``usage.input_tokens``."""
        try:
            return sum(self.engine.input_tokens(span) for span in plan.request.spans())
        except EngineError:  # it was spoken, so this cannot happen; usage is no reason to fail
            return 0

    # -- whole answers -------------------------------------------------------------------------

    def synthesize(
        self, plan: Plan, output: Output, should_stop: Callable[[], bool] | None
    ) -> Speech:
        """The whole answer, from the cache when it holds it (in this format, or as PCM to
        encode again), else made (a script's spans each from the cache or the engine); filled
        on the way back unless degraded mode cut a segment short."""
        identity, rate = self.engine.identity, self.engine.sample_rate
        key = cache_key(plan.request, identity, output.cache_format(rate))
        cached = self.cache.get(key)
        segments = None
        if cached is not None:
            body, seconds, cache_status = cached[0], cached[1], "HIT"
        else:
            pcm_key = cache_key(plan.request, identity, "pcm")
            pcm = self.cache.get(pcm_key)
            cacheable = True
            if pcm is not None:  # the same speech was made for another format: encode it again
                audio, seconds, cache_status = from_pcm16(pcm[0]), pcm[1], "HIT"
            else:
                made = self._whole(plan, should_stop)
                audio, seconds = made.audio, len(made.audio) / rate
                # a script whose every span was in the cache is a hit too
                cache_status = "MISS" if made.segments else "HIT"
                segments = made.segments or None
                cacheable = _cacheable(plan, made.truncated)
                if cacheable:
                    self.cache.put(pcm_key, (to_pcm16(audio), seconds))
            body = encode(audio, rate, output.format, output.rate(rate))
            if cacheable:
                self.cache.put(key, (body, seconds))
        self._count_served(cache_status, seconds)
        return Speech(
            body, content_type(output.format, output.rate(rate)), cache_status, seconds, segments
        )

    def captioned(
        self, plan: Plan, output: Output, should_stop: Callable[[], bool] | None
    ) -> CaptionedSpeech:
        """The whole answer with a caption per sentence (each span reads each sentence as its
        own segment), each naming its speaker; cached with its captions, as they are one
        answer."""
        identity, rate = self.engine.identity, self.engine.sample_rate
        key = cache_key(plan.request, identity, f"captioned/{output.cache_format(rate)}")
        cached = self.cache.get(key)
        if cached is not None:
            body, seconds, items, segments = cached
            cache_status = "HIT"
        else:
            made = self._whole(plan, should_stop, with_captions=True)
            items = tuple(at_rate(made.captions, output.rate(rate)))
            body = encode(made.audio, rate, output.format, output.rate(rate))
            seconds, segments, cache_status = len(made.audio) / rate, made.segments, "MISS"
            if _cacheable(plan, made.truncated):
                self.cache.put(key, (body, seconds, items, segments))
        self._count_served(cache_status, seconds)
        return CaptionedSpeech(
            body,
            content_type(output.format, output.rate(rate)),
            cache_status,
            seconds,
            items,
            segments,
        )

    def _whole(
        self, plan: Plan, should_stop: Callable[[], bool] | None, with_captions: bool = False
    ) -> Made:
        """Every span made (from the cache, or generated side by side) and joined by the
        script's silences. ``with_captions``: every span generated, for its sentences' places."""
        rate, deadline = self.engine.sample_rate, _Deadline(self.settings.request_timeout_s)
        spans, trailing = self._begin(plan, stream=False, from_cache=not with_captions)
        pieces: list[np.ndarray] = []
        items: list[Caption] = []
        segments = truncated = offset = 0
        try:
            for span in spans:
                pieces.append(np.zeros(span.gap, dtype=np.float32))
                offset += span.gap
                if span.run is None:
                    assert span.pcm is not None  # from the cache
                    audio = from_pcm16(span.pcm)
                else:
                    run = span.run
                    result = self._finish(run, should_stop, deadline.left())
                    span.run = None  # answered: counted off the queue
                    audio = result.audio
                    segments += result.segments
                    truncated += result.truncated
                    if plan.request.parts and _cacheable(plan, result.truncated):
                        self.cache.put(span.pcm_key, (to_pcm16(audio), result.seconds))
                    if with_captions:
                        made = captions(
                            run.sentences,
                            result.part_samples,
                            result.part_texts,
                            result.pause_samples,
                            rate,
                        )
                        speaker = span.request.speaker if plan.request.parts else None
                        items += shifted(made, offset, speaker)
                pieces.append(audio)
                offset += len(audio)
        finally:
            self._drop(spans)
        pieces.append(np.zeros(trailing, dtype=np.float32))
        return Made(np.concatenate(pieces), segments, truncated, tuple(items))

    def _finish(
        self, run: Run, should_stop: Callable[[], bool] | None, timeout: float | None
    ) -> Synthesis:
        started = time.perf_counter()
        try:
            result = run.result(timeout, should_stop)
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
        MP3, Opus, AAC and G.711 encoded chunk by chunk); a script's spans in order, each from
        the cache or as it is decoded, its silences between them. Queueing errors raise here,
        before any byte; later failures break the stream (``StreamBroken``)."""
        metrics, rate = self.metrics, self.engine.sample_rate
        pcm_key = cache_key(plan.request, self.engine.identity, "pcm")
        writer = stream_writer(output.format, rate, output.rate(rate))
        cached = self.cache.get(pcm_key)
        early = not (output.by_default and self.settings.default_stream == "segments")
        spans, trailing = ([], 0) if cached is not None else self._begin(plan, True, early)
        generated = any(span.run is not None for span in spans)
        cache_status = "HIT" if not generated else "MISS"

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
                self._count_served(cache_status, 0.0)
                playback = Playback()  # a listener playing from the first chunk handed over
                deadline = _Deadline(self.settings.request_timeout_s)
                provisional = truncated = 0
                for span in spans:
                    pieces = [_silence(span.gap)]
                    if span.pcm is not None:
                        pieces.append(span.pcm)
                    for pcm in pieces:
                        parts.append(pcm)
                        data = writer.encode(pcm)
                        if data:
                            yield data
                    if span.run is None:
                        continue
                    begun = len(parts)
                    yield from self._stream_run(
                        span.run, plan, writer, parts, started, playback, should_stop, deadline
                    )
                    run, span.run = span.run, None  # answered: counted off the queue
                    metrics.queue_depth.dec()
                    provisional += run.provisional
                    truncated += run.truncated
                    if (
                        plan.request.parts
                        and not run.provisional
                        and _cacheable(plan, run.truncated)
                    ):
                        span_pcm = b"".join(parts[begun:])
                        self.cache.put(span.pcm_key, (span_pcm, len(span_pcm) / 2 / rate))
                parts.append(_silence(trailing))
                tail = writer.encode(parts[-1]) + writer.finish()
                if tail:
                    yield tail
                if playback.first is not None:
                    metrics.stream_behind.observe(playback.behind)
                seconds = sum(len(part) for part in parts) / 2 / rate
                # a start decoded with a look-ahead is close to the whole answer, not it
                if provisional:
                    metrics.provisional_audio.inc(provisional * SAMPLES_PER_STEP / rate)
                elif _cacheable(plan, truncated):
                    self.cache.put(pcm_key, (b"".join(parts), seconds))
            except StreamBroken as broken:
                outcome = broken.error
                raise
            except GeneratorExit:  # the client went away while we were sending
                outcome = Cancelled("the client went away")
                if any(span.run is not None for span in spans):
                    metrics.infer_total.labels(outcome="cancelled").inc()
                raise
            finally:
                self._drop(spans)
                seconds = seconds or sum(len(part) for part in parts) / 2 / rate
                metrics.audio_seconds.inc(seconds)
                speech.seconds = seconds
                on_end(outcome, seconds, cache_status)

        def close_unsent() -> None:
            self._drop(spans)
            on_end(Cancelled("the client went away before the first byte"), 0.0, cache_status)

        speech = SpeechStream(
            chunks(),
            content_type(output.format, output.rate(rate)),
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
        playback: Playback,
        should_stop: Callable[[], bool] | None,
        deadline: _Deadline,
    ) -> Iterator[bytes]:
        try:
            for chunk in run.chunks(deadline.left(), should_stop):
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
        self.metrics.infer_total.labels(outcome="ok").inc()
        self.metrics.infer_duration.observe(time.perf_counter() - started)

    # -- shared --------------------------------------------------------------------------------

    def _begin(
        self, plan: Plan, stream: bool, early: bool = True, from_cache: bool = True
    ) -> tuple[list[_Span], int]:
        """Each span of the request (the request itself, or a script's spans) with the
        silence before it: a script's span from the cache where it holds it, the others
        queued at once, so they generate side by side, taking their turns in the scheduler
        as one request. Also the silence after the last span."""
        request, rate = plan.request, self.engine.sample_rate
        gaps = request.gaps(round(self.settings.segment_pause_ms / 1000.0 * rate))
        number, first = self.engine.request_number(), 0
        spans: list[_Span] = []
        for span_request, gap in zip(request.spans(), gaps, strict=False):
            key = cache_key(span_request, self.engine.identity, "pcm")
            cached = self.cache.get(key) if from_cache and request.parts else None
            spans.append(_Span(span_request, gap, key, cached[0] if cached else None))
        if request.parts:  # room for every span's segments at once, or none started
            try:
                needed = [len(self.engine.segments(s.request)) for s in spans if s.pcm is None]
                self.engine.admit(sum(needed))
            except EngineError as error:
                self._count_failure(error)
                raise
        try:
            for span in spans:
                if span.pcm is None:
                    span.run = self._start(
                        replace(plan, request=span.request), stream, early, (number, first)
                    )
                    first += len(span.run.jobs)
        except BaseException:
            self._drop(spans)
            raise
        return spans, gaps[-1]

    def _drop(self, spans: list[_Span]) -> None:
        """Cancel the spans still generating (a failure, a client gone) and count them off
        the queue."""
        for span in spans:
            if span.run is not None:
                span.run.cancel()
                span.run = None
                self.metrics.queue_depth.dec()

    def _start(
        self, plan: Plan, stream: bool, early: bool = True, share: tuple[int, int] | None = None
    ) -> Run:
        """Queue a request's segments; the queue depth gauge counts it until it is answered."""
        try:
            run = self.engine.start(
                plan.request,
                stream=stream,
                step_cap=plan.step_cap,
                priority=plan.priority,
                tenant=plan.tenant,
                early=early,
                share=share,
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


class _Deadline:
    """One time limit for a whole request, however many spans it waits for in turn."""

    def __init__(self, seconds: float | None):
        self._at = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        return None if self._at is None else max(0.0, self._at - time.monotonic())


def _silence(samples: int) -> bytes:
    return bytes(2 * samples)


def from_pcm16(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0


def _cacheable(plan: Plan, truncated: int) -> bool:
    """A degraded answer (a lowered step cap) is what the request gets normally unless the
    lowered cap cut a segment short: only then is it kept out of the cache."""
    return not plan.degraded or truncated == 0
