"""One segment inside the scheduler: optional text refinement, speech codes, then audio.

Every method runs on the scheduler's thread, which owns all heavy torch work. A streaming job
decodes its audio in chunks while it generates (``progress``); each chunk is decoded with
enough context on both sides (the decoders' receptive field) to be identical to the same
stretch of a decode of the whole, so streamed and non-streamed audio match.
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
    from chattts_service.inference.decoding import AudioDecoder
    from chattts_service.inference.prompts import Prompts

log = logging.getLogger(__name__)

FIRST_CHUNK_STEPS = 8  # streamed audio: first chunk (170 ms), then doubling
MAX_CHUNK_STEPS = 96


class SynthesisJob:
    """``decoder(hiddens)`` turns hidden states into audio, and its ``context_steps`` is how
    many steps of context on each side make a chunk exact; ``on_finished(seconds)`` hears how
    long the job took from its start (the admission's wait estimate)."""

    def __init__(
        self,
        prompts: Prompts,
        decoder: AudioDecoder,
        text: str,
        request: SynthesisRequest,
        voice,
        fixed_steps: int | None,
        stream: bool,
        step_cap: int | None = None,
        on_finished: Callable[[float], None] | None = None,
        early: bool = True,
    ):
        self.prompts, self.decode = prompts, decoder
        self.context_steps = decoder.context_steps
        self.text, self.request, self.voice = text, request, voice
        self.fixed_steps, self.step_cap = fixed_steps, step_cap
        self.on_finished = on_finished
        self.started: float | None = None
        self.future = JobFuture()
        self.chunks: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        self.early = early  # a stream: chunks as it generates, else its whole audio at the end
        self._parts: list[np.ndarray] = []
        self._emitted = 0  # steps whose audio has been sent
        self._next_chunk = FIRST_CHUNK_STEPS

    def start(self):
        self.started = time.monotonic()
        if self.request.refine_text:
            return self.prompts.text_sequence(self.text, self.request)
        return self._code_sequence()

    def _code_sequence(self):
        return self.prompts.code_sequence(
            self.text, self.request, self.voice, self.fixed_steps, self.step_cap
        )

    def progress(self, sequence) -> None:
        if self.chunks is None or not self.early or sequence.kind != "code":
            return
        ready = sequence.steps - self.context_steps
        if ready - self._emitted >= self._next_chunk:
            self._emit(sequence, ready, final=False)
            self._next_chunk = min(2 * self._next_chunk, MAX_CHUNK_STEPS)

    def _emit(self, sequence, until: int, final: bool) -> None:
        start = max(0, self._emitted - self.context_steps)
        chunk = self.decode.span(
            sequence.hiddens[start : sequence.steps],
            self._emitted - start,
            None if final else until - start,
        )
        self._parts.append(chunk)
        self.chunks.put(chunk)
        self._emitted = until

    def advance(self, finished):
        if finished.kind == "text":
            self.text = self.prompts.refined_text(finished)
            if not speakable(self.text):
                raise NothingToSay("text has nothing speakable after refinement")
            return self._code_sequence()
        if finished.steps == 0:
            raise EngineError("the model ended speech before producing any audio")
        if self.chunks is not None and self.early:
            self._emit(finished, finished.steps, final=True)
            self.chunks.put(None)
            audio = np.concatenate(self._parts)
        else:
            audio = self.decode(finished.result_hiddens())
            if self.chunks is not None:  # a stream that takes its audio a segment at a time
                self.chunks.put(audio)
                self.chunks.put(None)
        truncated = self.fixed_steps is None and finished.steps >= finished.max_steps
        if truncated:
            log.warning(
                "a segment reached its step cap (%d steps) before ending its speech",
                finished.max_steps,
            )
        if self.on_finished is not None:
            self.on_finished(time.monotonic() - self.started)
        self.future.set_result(
            Synthesis(
                audio=audio,
                sample_rate=SAMPLE_RATE,
                steps=finished.steps,
                spoken_text=self.text,
                truncated=int(truncated),
            )
        )
        return None
