"""What a speech request is and what it gives: requests, results, errors, sampling defaults.

Nothing here imports torch, so the API layer can build requests and catch engine errors
without paying for the model's imports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from chattts_service.domain.voices import Voice

SAMPLE_RATE = 24_000
SAMPLES_PER_STEP = 512  # 2 mel frames of hop 256 per GPT step
DEFAULT_SPEED = 5  # ChatTTS's default speech prompt is [speed_5]
# a request's class in the scheduler (``inference.fairness``): someone waits for its sound, or
# it is a batch job that may wait behind those who do
INTERACTIVE = "interactive"
BULK = "bulk"
PRIORITIES = (INTERACTIVE, BULK)


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float


# ChatTTS's defaults: for speech codes (a request may change all but the repetition penalty)
# and for text refinement
CODE_SAMPLING = Sampling(temperature=0.3, top_p=0.7, top_k=20, repetition_penalty=1.05)
TEXT_SAMPLING = Sampling(temperature=0.7, top_p=0.7, top_k=20, repetition_penalty=1.0)


class EngineError(Exception):
    """Inference could not produce audio for a request. ``outcome`` labels it in metrics."""

    outcome = "error"


class NothingToSay(EngineError):
    """After text normalisation nothing speakable is left."""

    outcome = "nothing_to_say"


class TooManySegments(EngineError):
    """The request needs more segments at once than the queue ever holds (a script of many
    spans, a long text read sentence by sentence): waiting would not help."""

    outcome = "too_many_segments"


class Overloaded(EngineError):
    """No room: the queue is full, or the estimated wait is longer than allowed."""

    outcome = "overloaded"

    def __init__(self, message: str, reason: str = "queue_full", retry_after: float = 5.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class Cancelled(EngineError):
    """The caller went away before the audio was ready; its work was dropped."""

    outcome = "cancelled"


class DeadlineExceeded(Cancelled):
    """The request did not finish within its time limit; its work was dropped."""

    outcome = "timeout"


@dataclass(frozen=True)
class SynthesisRequest:
    """Everything that changes the audio. The cache key is built from these fields."""

    text: str
    seed: int  # sampling seed; also the voice when ``voice`` is None
    refine_text: bool = False
    voice: Voice | None = None
    speed: int = DEFAULT_SPEED  # ChatTTS's [speed_N] level, 0-9
    temperature: float = CODE_SAMPLING.temperature
    top_p: float = CODE_SAMPLING.top_p
    top_k: int = CODE_SAMPLING.top_k
    normalize: bool = True  # numbers, dates, money... written out in words first
    refine_prompt: str = ""  # [oral_N][laugh_N][break_N] for the refinement pass
    sentence_segments: bool = False  # each sentence its own segment(s): captions need it
    language: str | None = None  # the normaliser's language (zh, en); None: detected
    # a script (SSML, a dialogue): spans spoken one after another, each a request of its own
    # (its text, voice, pace), and silences between them; ``text`` is then the whole text as
    # written. Empty: the request is its text.
    parts: tuple[SynthesisRequest | Silence, ...] = ()

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, CODE_SAMPLING.repetition_penalty)

    @property
    def speaker(self) -> str:
        """Who speaks it, as captions name them: its voice, or ``seed:N``."""
        return self.voice.name if self.voice is not None else f"seed:{self.seed}"

    def spans(self) -> list[SynthesisRequest]:
        """What is spoken, in order: the script's spans, or the request itself."""
        if not self.parts:
            return [self]
        return [part for part in self.parts if isinstance(part, SynthesisRequest)]

    def each_span(self, **change: Any) -> SynthesisRequest:
        """The request with ``change`` made to it and to every span of its script."""
        parts = tuple(
            replace(part, **change) if isinstance(part, SynthesisRequest) else part
            for part in self.parts
        )
        return replace(self, parts=parts, **change)

    def gaps(self, pause_samples: int) -> list[int]:
        """The silence before each span, then after the last one, in samples: the silences
        between two spans where the script has any (exactly their sum), else ``pause_samples``
        (the pause between segments); a script's leading and trailing silences as written."""
        if not self.parts:
            return [0, 0]
        gaps: list[int] = []
        pending: int | None = None  # the silences written since the last span, if any
        for part in self.parts:
            if isinstance(part, Silence):
                pending = (pending or 0) + part.samples
                continue
            if pending is None:  # nothing written: none before the first span, else the pause
                pending = pause_samples if gaps else 0
            gaps.append(pending)
            pending = None
        gaps.append(pending or 0)
        return gaps


@dataclass(frozen=True)
class Silence:
    """A pause of exactly this long in a script (SSML's ``<break>``, a dialogue's gap)."""

    milliseconds: int

    @property
    def samples(self) -> int:
        return round(self.milliseconds * SAMPLE_RATE / 1000)


@dataclass(frozen=True)
class Synthesis:
    audio: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int
    steps: int
    spoken_text: str
    segments: int = 1
    truncated: int = 0  # segments stopped by the step cap instead of ending their speech
    # steps streamed with a look-ahead shorter than the decoder's context: their samples are
    # close to the whole answer's, not the same (CHATTTS_STREAM_LOOKAHEAD)
    provisional: int = 0
    # the samples and spoken text of each segment, in order (joined by ``pause_samples``)
    part_samples: tuple[int, ...] = ()
    part_texts: tuple[str, ...] = ()
    pause_samples: int = 0

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sample_rate
