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
next when what has been sent runs low (``LOW_WATER_SECONDS`` of audio ahead of a player that
started at the first chunk), or when a decode runs anyway and joining it pays, or when the
chunk has grown to ``MAX_CHUNK_STEPS``. A stream ahead of its listener waits for a bigger
piece, so the fixed cost of each decode round weighs less per second of audio.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from chattts_service.inference.scheduler import JobFuture
from chattts_service.inference.types import (
    SAMPLE_RATE,
    EngineError,
    NothingToSay,
    Synthesis,
    SynthesisRequest,
    speakable,
)

if TYPE_CHECKING:  # prompts bring torch; a job is built once the model has loaded it
    from chattts_service.inference.decoding import DecodeQueue
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
# chunks are decoded too. (Tuned on 2 vCPUs of a Xeon with AMX, docs/benchmarks.md.)
FIRST_CHUNK_STEPS = 12
JOIN_FIRST_STEPS = 10
LOW_CHUNK_STEPS = 32
JOIN_CHUNK_STEPS = 16
MAX_CHUNK_STEPS = 128
LOW_WATER_SECONDS = 0.6
HIGH_WATER_SECONDS = 2.0


class SynthesisJob:
    """``decoder`` decodes hidden states into audio between two steps, and its
    ``decoder.context_steps`` is how many steps of context on each side make a chunk exact;
    ``on_finished(seconds)`` hears how long the job took from its start (the admission's wait
    estimate)."""

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
        early: bool = True,
    ):
        self.prompts, self.decodes = prompts, decoder
        self.context_steps = decoder.decoder.context_steps
        self.text, self.request, self.voice = text, request, voice
        self.fixed_steps, self.step_cap = fixed_steps, step_cap
        self.on_finished = on_finished
        self.started: float | None = None
        self.future = JobFuture()
        self.chunks: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        self.early = early  # a stream: chunks as it generates, else its whole audio at the end
        self._parts: list[np.ndarray] = []
        # where the decoder's stages are between this stream's chunks (None: it decodes each
        # chunk's window with its context again)
        self._stream = decoder.decoder.stream() if stream and early else None
        self._emitted = 0  # steps whose audio has been asked for
        self._runs_out: float | None = None  # when the listener's audio runs out
        self._asked = 0  # chunks asked for

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

    def progress(self, sequence, joining: bool = False) -> bool:
        """After a step: ask for the next chunk if it is due (``joining``: a decode runs anyway
        this time, so a smaller chunk is worth sending); whether it did."""
        if self.chunks is None or not self.early or sequence.kind != "code":
            return False
        waiting = sequence.steps - self.context_steps - self._emitted  # decodable, not asked for
        size = min(FIRST_CHUNK_STEPS << max(0, self._asked - 1), MAX_CHUNK_STEPS)
        if self._runs_out is None:  # nothing has reached the listener yet
            due = waiting >= size or (joining and waiting >= JOIN_FIRST_STEPS)
        else:
            ahead = self.ahead()
            due = (
                waiting >= MAX_CHUNK_STEPS
                or (ahead < LOW_WATER_SECONDS and waiting >= min(size, LOW_CHUNK_STEPS))
                or (
                    joining
                    and ahead < HIGH_WATER_SECONDS
                    and waiting >= min(size, JOIN_CHUNK_STEPS)
                )
            )
        if due:
            self._asked += 1
            self._emit(sequence, self._emitted + waiting, final=False)
        return due

    def _emit(self, sequence, until: int, final: bool, then=None) -> None:
        start = max(0, self._emitted - self.context_steps)

        def sent(chunk: np.ndarray) -> None:
            now = time.monotonic()
            if self._runs_out is None or self._runs_out < now:  # (re)starts playing now
                self._runs_out = now
            self._runs_out += len(chunk) / SAMPLE_RATE
            self._parts.append(chunk)
            self.chunks.put(chunk)
            if then is not None:
                then()

        if self._stream is not None:
            self.decodes.submit_stream(
                self._stream, sequence.hiddens[: sequence.steps], until, final, sent, self._failed
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
        if self.chunks is not None and self.early:

            def streamed() -> None:
                self.chunks.put(None)
                self._finish(finished, np.concatenate(self._parts))

            self._emit(finished, finished.steps, final=True, then=streamed)
            return None

        def whole(audio: np.ndarray) -> None:
            if self.chunks is not None:  # a stream that takes its audio a segment at a time
                self.chunks.put(audio)
                self.chunks.put(None)
            self._finish(finished, audio)

        self.decodes.submit(finished.result_hiddens(), 0, None, whole, self._failed)
        return None

    def _finish(self, finished, audio: np.ndarray) -> None:
        truncated = self.fixed_steps is None and finished.steps >= finished.max_steps
        if truncated:
            log.warning(
                "a segment reached its step cap (%d steps) before ending its speech",
                finished.max_steps,
            )
        if self.on_finished is not None:
            self.on_finished(time.monotonic() - self.started)
        if not self.future.done():
            self.future.set_result(
                Synthesis(
                    audio=audio,
                    sample_rate=SAMPLE_RATE,
                    steps=finished.steps,
                    spoken_text=self.text,
                    truncated=int(truncated),
                )
            )
