"""One segment inside the scheduler: optional text refinement, speech codes, then audio.

Every method runs on the scheduler's thread, which owns all heavy torch work. Audio is decoded
through the scheduler's ``DecodeQueue``: what every job asks for between two steps is decoded
together. A streaming job decodes its audio in chunks while it generates (``progress``); each
chunk is decoded with enough context on both sides (the decoders' receptive field) to be the
same stretch of a decode of the whole, so streamed and non-streamed audio match.

A stream's decoder keeps, stage by stage, the inputs its next outputs read (``StreamState``), so
a chunk costs its own frames rather than its window and context again.

A stream's chunks follow its listener: the first as soon as it can be decoded (a little
earlier to join a decode that runs anyway), the second as soon as as many steps wait, then the
next when what has been sent runs low (``low_water_seconds`` of audio ahead of a player that
started at the first chunk: more where its steps come slower or stall), or when a decode runs
anyway and joining it pays, or when the chunk has grown to ``MAX_CHUNK_STEPS``. A stream
ahead of its listener waits for a bigger piece, so the fixed cost of each decode round weighs
less per second of audio.

With a look-ahead (CHATTTS_STREAM_LOOKAHEAD, opt-in) a stream starts sooner: its chunks are
decoded as windows that end where generation is, that many steps after the chunk, instead of
the decoder's whole context (52 steps on ChatTTS's), until its listener holds enough audio for
exact chunks to catch up (they need the context generated first; meanwhile the stream sends
pieces to build that much) or ``PROVISIONAL_MAX_STEPS`` have gone that way; from there on its
chunks are exact. Those first chunks' samples differ slightly from the whole answer's (how much:
``benchmarks/streams.py --lookahead``), so such a stream's audio is marked (``provisional``)
and never cached.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from chattts_service.domain.speech import (
    BULK,
    SAMPLE_RATE,
    SAMPLES_PER_STEP,
    EngineError,
    NothingToSay,
    Synthesis,
    SynthesisRequest,
)
from chattts_service.domain.text import speakable
from chattts_service.inference.scheduler import JobFuture

if TYPE_CHECKING:  # prompts bring torch; a job is built once the model has loaded it
    from chattts_service.inference.decode_queue import DecodeQueue
    from chattts_service.inference.prompts import Prompts

log = logging.getLogger(__name__)

# A stream's chunks: the first once FIRST_CHUNK_STEPS can be decoded (256 ms of audio), or
# JOIN_FIRST_STEPS when a decode runs anyway (streams that started a step or two apart then
# share their first rounds, where each paid one and a stream a step ahead waited for the
# others'); each later one once its listener has less than LOW_WATER_SECONDS of audio left
# (HIGH_WATER_SECONDS when a decode runs anyway, so it joins that batch) and its size has
# waited (FIRST_CHUNK_STEPS for the second chunk too, then doubling, capped at LOW_CHUNK_STEPS,
# or JOIN_CHUNK_STEPS to join); any chunk once MAX_CHUNK_STEPS wait. The second is no bigger
# than the first: its listener holds only the first's 256 ms while the other streams' first
# chunks are decoded too. (Tuned with ``bench.py --capacity`` on 2 vCPUs.)
FIRST_CHUNK_STEPS = 12
JOIN_FIRST_STEPS = 10
LOW_CHUNK_STEPS = 32
JOIN_CHUNK_STEPS = 16
MAX_CHUNK_STEPS = 128
LOW_WATER_SECONDS = 0.6
HIGH_WATER_SECONDS = 2.0
# On a busy box the low water rises with what the stream measures (``low_water_seconds``): the
# time its next chunk of LOW_CHUNK_STEPS takes at its recent pace, slowed by PACE_MARGIN, plus
# the longest gap between two of its steps lately (a stall: prefill pieces, a decode round's
# stages, its row taken back) or wait from asking for a chunk to its audio (the round's stages
# run between steps), which halves every WORST_GAP_HALF_LIFE seconds, plus DRY_MARGIN_SECONDS.
WORST_GAP_HALF_LIFE = 5.0
# Below its low water a stream waits for its chunk's size only while its listener would still
# hold DRY_MARGIN_SECONDS (about a decode round and a step) once the missing steps arrive at the
# stream's own pace; otherwise it sends what waits, FIRST_CHUNK_STEPS at least: on a slow host
# the sizes above alone ran a lone listener dry.
DRY_MARGIN_SECONDS = 0.15
# A stream with a look-ahead turns to exact chunks once its listener holds the audio of the
# steps that must be generated before the first exact chunk can be decoded, times this margin
# (later streams slow every step), plus CATCH_UP_SECONDS for that chunk's decode; until then
# that is its low water. It turns exact after PROVISIONAL_MAX_STEPS anyway: a window decoded
# with its context costs about three times a chunk decoded stage by stage, and a box too busy
# to build that much audio ahead cannot afford it for long. A stream whose pace (measured over
# the steps before its first chunk, then slowed by PACE_MARGIN: streams that join later slow
# every step) could not build it within PROVISIONAL_MAX_STEPS starts exact instead: turning
# exact later would leave its listener waiting (``look_ahead_step_limit``: the slowest step at
# which it starts with the look-ahead).
CATCH_UP_MARGIN = 1.5
CATCH_UP_SECONDS = 0.2
PROVISIONAL_MAX_STEPS = 64
PACE_MARGIN = 1.5


def catch_up_seconds(step_seconds: float, context_steps: int, lookahead: int) -> float:
    """The audio a listener must hold for a stream with a look-ahead to turn exact without
    running dry: the first exact chunk needs ``context_steps - lookahead`` more steps
    generated, then its own ``FIRST_CHUNK_STEPS``, then its decode."""
    steps = context_steps - lookahead + FIRST_CHUNK_STEPS
    return CATCH_UP_MARGIN * steps * step_seconds + CATCH_UP_SECONDS


def low_water_seconds(step_seconds: float, worst_gap: float) -> float:
    """The audio a stream keeps ahead of its listener before it asks for its next chunk: at
    least ``LOW_WATER_SECONDS``, more where its steps come slower or a recent stall was long."""
    needed = PACE_MARGIN * LOW_CHUNK_STEPS * step_seconds + worst_gap + DRY_MARGIN_SECONDS
    return max(LOW_WATER_SECONDS, needed)


def later_chunk_due(
    waiting: int,
    size: int,
    ahead: float,
    step_seconds: float,
    low_water: float = LOW_WATER_SECONDS,
    joining: bool = False,
) -> bool:
    """Whether a stream that has sent audio asks for its next chunk now: ``waiting`` steps
    decodable and not asked for, ``size`` the chunk it grows to, its listener ``ahead``
    seconds, a step every ``step_seconds`` (its recent pace), ``joining``: a decode runs
    anyway this time."""
    if waiting >= MAX_CHUNK_STEPS:
        return True
    if ahead < low_water:
        low = min(size, LOW_CHUNK_STEPS)
        if waiting >= low:
            return True
        # the rest of the chunk would come too late: send what waits
        if waiting >= FIRST_CHUNK_STEPS and ahead - (low - waiting) * step_seconds < (
            DRY_MARGIN_SECONDS
        ):
            return True
    return joining and ahead < HIGH_WATER_SECONDS and waiting >= min(size, JOIN_CHUNK_STEPS)


def look_ahead_step_limit(context_steps: int, lookahead: int) -> float:
    """The slowest step (seconds) at which a stream starts with its look-ahead: at that pace
    slowed by ``PACE_MARGIN``, a first chunk and ``PROVISIONAL_MAX_STEPS`` more of provisional
    audio leave its listener ``catch_up_seconds`` ahead (below zero: never)."""
    audio = SAMPLES_PER_STEP / SAMPLE_RATE  # seconds a step adds
    steps = context_steps - lookahead + FIRST_CHUNK_STEPS
    built = (FIRST_CHUNK_STEPS + PROVISIONAL_MAX_STEPS) * audio - CATCH_UP_SECONDS
    return built / (PROVISIONAL_MAX_STEPS * PACE_MARGIN + CATCH_UP_MARGIN * steps)


class SynthesisJob:
    """``decoder`` decodes hidden states into audio between two steps, and its
    ``decoder.context_steps`` is how many steps of context on each side make a chunk exact;
    ``on_finished(seconds)`` hears how long the job took from its start (the admission's wait
    estimate); ``lookahead``: a stream's steps of look-ahead while it starts (0, or as many as
    the decoder's context: exact from the first chunk); ``early``: a stream's audio in chunks
    as it generates (else each segment's once it is decoded whole)."""

    def __init__(
        self,
        prompts: Prompts,
        decoder: DecodeQueue,
        text: str,
        request: SynthesisRequest,
        voice,
        fixed_steps: int | None,
        stream: bool,
        step_cap: int | None = None,
        on_finished: Callable[[float], None] | None = None,
        lookahead: int = 0,
        early: bool = True,
    ):
        self.prompts, self.decodes = prompts, decoder
        self.early = early  # a stream: chunks as it generates, else each segment's whole audio
        self.context_steps = decoder.decoder.context_steps
        self.lookahead = lookahead if 0 < lookahead < self.context_steps else None
        self.text, self.request, self.voice = text, request, voice
        self.fixed_steps, self.step_cap = fixed_steps, step_cap
        self.on_finished = on_finished
        self.started: float | None = None
        self.future = JobFuture()
        # its place in the scheduler's shares: (class, API key, request, index), set by the
        # engine (``fairness.Share``)
        self.placement: tuple | None = None
        self.chunks: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        self._parts: list[np.ndarray] = []
        # where the decoder's stages are between this stream's chunks (None: it decodes each
        # chunk's window with its context again)
        self._stream = decoder.decoder.stream() if stream and early else None
        self._emitted = 0  # steps whose audio has been asked for
        self._runs_out: float | None = None  # when the listener's audio runs out
        self._asked = 0  # chunks asked for
        self._exact = self.lookahead is None  # chunks are decoded with their whole context
        self._provisional = 0  # steps whose audio was asked for with the look-ahead only
        self._exact_samples = 0  # samples the stream's exact decodes have given so far
        self._last_step: float | None = None
        self._step_seconds = 0.0  # recent time between two steps of this stream (smoothed)
        # the longest time between two of its steps, or from asking for a chunk to its audio
        # (a decode round runs a stage at a time between steps), lately (decaying)
        self._worst_gap = 0.0

    def start(self):
        self.started = time.monotonic()
        if self.request.refine_text:
            return self.prompts.text_sequence(self.text, self.request)
        return self._code_sequence()

    def _code_sequence(self):
        return self.prompts.code_sequence(
            self.text, self.request, self.voice, self.fixed_steps, self.step_cap
        )

    def ahead(self, now: float | None = None) -> float:
        """Seconds of audio sent and not yet played by a listener who started at the first
        chunk and waits when it has nothing left (0 then, and before the first chunk)."""
        if self._runs_out is None:
            return 0.0
        return max(0.0, self._runs_out - (time.monotonic() if now is None else now))

    def slack(self) -> float | None:
        """A stream's audio ahead of its listener beyond its low water: the time a decode
        round may take beyond its own chunks without the listener running dry (None before
        its first chunk)."""
        if self._runs_out is None:
            return None
        return self.ahead() - low_water_seconds(self._step_seconds, self._worst_gap)

    def progress(self, sequence, joining: bool = False) -> bool:
        """After a step: ask for the next chunk if it is due (``joining``: a decode runs anyway
        this time, so a smaller chunk is worth sending); whether it did."""
        if self.chunks is None or not self.early or sequence.kind != "code":
            return False
        self._time_step()
        low_water = low_water_seconds(self._step_seconds, self._worst_gap)
        lookahead = self.lookahead  # None: exact from the start
        if not self._exact and lookahead is not None:
            catch_up = catch_up_seconds(self._step_seconds, self.context_steps, lookahead)
            if self._asked and (
                self.ahead() >= catch_up or self._provisional >= PROVISIONAL_MAX_STEPS
            ):
                self._exact = True
                self._asked = 1  # the first exact chunk as small as a stream's second
            else:
                low_water = max(low_water, catch_up)
        reach = self.context_steps if self._exact else self.lookahead
        waiting = sequence.steps - reach - self._emitted  # decodable, not asked for
        size = min(FIRST_CHUNK_STEPS << max(0, self._asked - 1), MAX_CHUNK_STEPS)
        if self._runs_out is None:  # nothing has reached the listener yet
            due = waiting >= size or (joining and waiting >= JOIN_FIRST_STEPS)
        else:
            due = later_chunk_due(
                waiting, size, self.ahead(), self._step_seconds, low_water, joining
            )
        if (
            due
            and not self._asked
            and not self._exact
            and lookahead is not None
            and self._step_seconds > look_ahead_step_limit(self.context_steps, lookahead)
        ):
            self._exact = True  # too busy a box to turn exact later: start as exact streams do
            return False
        if due:
            self._asked += 1
            self._emit(sequence, self._emitted + waiting, final=False)
        return due

    def _time_step(self) -> None:
        now = time.monotonic()
        if self._last_step is not None:
            gap = now - self._last_step
            self._step_seconds = (
                gap if not self._step_seconds else 0.8 * self._step_seconds + 0.2 * gap
            )
            self._worst_gap = max(gap, self._worst_gap * 0.5 ** (gap / WORST_GAP_HALF_LIFE))
        self._last_step = now

    def _emit(self, sequence, until: int, final: bool, then=None) -> None:
        start = max(0, self._emitted - self.context_steps)
        asked = time.monotonic()

        chunks = self.chunks
        assert chunks is not None  # only streams emit

        def sent(chunk: np.ndarray) -> None:
            if len(chunk):
                now = time.monotonic()
                self._worst_gap = max(self._worst_gap, now - asked)
                runs_out = self._runs_out
                if runs_out is None or runs_out < now:  # (re)starts playing now
                    runs_out = now
                self._runs_out = runs_out + len(chunk) / SAMPLE_RATE
                self._parts.append(chunk)
                chunks.put(chunk)
            if then is not None:
                then()

        if not (final or self._exact):  # a window ending where generation is
            self._provisional = until
            self.decodes.submit(
                sequence.hiddens[start : sequence.steps],
                self._emitted - start,
                until - start,
                sent,
                self._failed,
            )
        elif self._stream is not None:
            sent_already = self._provisional * SAMPLES_PER_STEP  # by the look-ahead's windows

            def exact(chunk: np.ndarray) -> None:
                # the stream's decoder gives its samples from the start: skip those sent already
                given, self._exact_samples = self._exact_samples, self._exact_samples + len(chunk)
                sent(chunk[max(0, min(len(chunk), sent_already - given)) :])

            self.decodes.submit_stream(
                self._stream, sequence.hiddens[: sequence.steps], until, final, exact, self._failed
            )
        else:
            self.decodes.submit(
                sequence.hiddens[start : sequence.steps],
                self._emitted - start,
                None if final else until - start,
                sent,
                self._failed,
            )
        self._emitted = until

    def _failed(self, error: Exception) -> None:
        log.error("decoding a segment's audio failed: %s", error)
        if not self.future.done():
            self.future.set_exception(error)

    def advance(self, finished):
        if finished.kind == "text":
            self.text = self.prompts.refined_text(finished)
            if not speakable(self.text):
                raise NothingToSay("text has nothing speakable after refinement")
            return self._code_sequence()
        if finished.steps == 0:
            raise EngineError("the model ended speech before producing any audio")
        chunks = self.chunks
        if chunks is not None and self.early:

            def streamed() -> None:
                chunks.put(None)
                self._finish(finished, np.concatenate(self._parts))

            self._emit(finished, finished.steps, final=True, then=streamed)
            return None

        def whole(audio: np.ndarray) -> None:
            if self.chunks is not None:  # a stream that takes its audio a segment at a time
                self.chunks.put(audio)
                self.chunks.put(None)
            self._finish(finished, audio)

        self.decodes.submit(
            finished.result_hiddens(),
            0,
            None,
            whole,
            self._failed,
            deferrable=self.placement is not None and self.placement[0] == BULK,
        )
        return None

    def _finish(self, finished, audio: np.ndarray) -> None:
        truncated = self.fixed_steps is None and finished.steps >= finished.max_steps
        if truncated:
            log.warning(
                "a segment reached its step cap (%d steps) before ending its speech",
                finished.max_steps,
            )
        if self.on_finished is not None and self.started is not None:
            self.on_finished(time.monotonic() - self.started)
        if not self.future.done():
            self.future.set_result(
                Synthesis(
                    audio=audio,
                    sample_rate=SAMPLE_RATE,
                    steps=finished.steps,
                    spoken_text=self.text,
                    truncated=int(truncated),
                    provisional=self._provisional,
                )
            )
