"""The decode queue: the audio decoding a scheduler iteration asked for, gathered and done
together on the model's thread, with bulk segments' windows decoded in the streams' slack."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from chattts_service.inference.decoding import Advance, AudioDecoder, Span, every_one

# what to decode (a window's span, or a stream's ``Advance``), then done(samples), failed(error)
Item = tuple[Span | Advance, Callable[[np.ndarray], None], Callable[[Exception], None]]


class DecodeQueue:
    """Audio decoding gathered between two GPT steps and done together on the model's thread
    (``run``): windows (``submit``) and streams' chunks (``submit_stream``), each kind as
    batches; each item's ``done(samples)`` is called in the order submitted, or
    ``failed(error)`` if its decode raised.

    A bulk segment's whole window (``submit(..., deferrable=True)``) may wait: decoding one
    holds every row for as long as its audio takes (a 6 s segment, tens of ms; several that end
    together, hundreds), which a stream that has little audio ahead of its listener cannot
    ride out. ``run(slack)`` decodes such windows only as far as their estimated time (at the
    measured pace) fits ``slack``, the seconds the streams can spare, oldest first, and one
    anyway once the oldest has waited ``MAX_DEFER_SECONDS``; ``slack`` None decodes them all.
    Each window is decoded whole, as when nobody listens: the same samples."""

    def __init__(self, decoder: AudioDecoder, on_run=None):
        self.decoder = decoder
        self.on_run = on_run  # on_run(items, seconds): the time spent decoding
        self._items: list[Item] = []
        self._deferred: list[tuple[float, Item]] = []  # (since, item): bulk windows waiting
        self._seconds_per_step = FIRST_DECODE_PACE_SECONDS  # recent pace of a round, a step

    def __len__(self) -> int:
        """Items asked for since the last round (a decode runs this iteration)."""
        return len(self._items)

    @property
    def pending(self) -> bool:
        """Bulk windows waiting for streams to have time to spare."""
        return bool(self._deferred)

    def submit(
        self, hiddens, first: int, last: int | None, done, failed, deferrable: bool = False
    ) -> None:
        """A window: the samples of steps [first, last) of ``hiddens`` (to the end: None).
        ``deferrable``: a bulk segment's whole audio, which may wait (see the class)."""
        item = ((hiddens, first, last), done, failed)
        if deferrable:
            self._deferred.append((time.monotonic(), item))
        else:
            self._items.append(item)

    def submit_stream(self, state, hiddens, until: int, final: bool, done, failed) -> None:
        """A stream's next chunk: ``AudioDecoder.advance_many`` on its steps so far."""
        self._items.append((Advance(state, hiddens, until, final), done, failed))

    def run(self, slack: float | None = None) -> None:
        """Decode what was asked for, and the deferred windows that ``slack`` allows (all of
        them with None)."""
        items, self._items = self._items, []
        now = time.monotonic()
        while self._deferred:
            since, item = self._deferred[0]
            cost = self._seconds_per_step * _steps(item[0])
            overdue = now - since >= MAX_DEFER_SECONDS
            if slack is not None and cost > slack and not overdue:
                break
            self._deferred.pop(0)
            items.append(item)
            if slack is not None:
                slack -= cost
                if overdue:
                    slack = min(slack, 0.0)  # one overdue window a round
        if not items:
            return
        started = time.perf_counter()
        try:
            decoded = self._decode([work for work, _, _ in items])
        except Exception as error:  # every item of the batch fails; the thread goes on
            for _, _, failed in items:
                failed(error)
            return
        finally:
            seconds = time.perf_counter() - started
            if self.on_run is not None:
                self.on_run(len(items), seconds)
        steps = sum(_steps(work) for work, _, _ in items)
        if steps:
            self._seconds_per_step = 0.8 * self._seconds_per_step + 0.2 * seconds / steps
        for (_, done, failed), samples in zip(items, decoded, strict=True):
            try:
                done(samples)
            except Exception as error:  # the item's own failure, not its neighbours'
                failed(error)

    def _decode(self, work: list) -> list[np.ndarray]:
        """Windows through ``decode_many`` and streams' chunks through ``advance_many``, the
        results in the order of ``work``."""
        chunks = [index for index, item in enumerate(work) if isinstance(item, Advance)]
        windows = [index for index, item in enumerate(work) if not isinstance(item, Advance)]
        results: list[np.ndarray | None] = [None] * len(work)
        for indices, decode in (
            (windows, self.decoder.decode_many),
            (chunks, self.decoder.advance_many),
        ):
            if indices:
                for index, samples in zip(indices, decode([work[i] for i in indices]), strict=True):
                    results[index] = samples
        return every_one(results)


# A bulk window waits at most this long for the streams to spare the time to decode it, and a
# round's time is estimated at this pace (seconds a step) until rounds have been timed.
MAX_DEFER_SECONDS = 2.0
FIRST_DECODE_PACE_SECONDS = 0.0005


def _steps(work) -> int:
    """The steps an item's decode reads: a stream chunk's new ones, a window's all."""
    if isinstance(work, Advance):
        return max(0, work.hiddens.shape[0] - work.state.fed)
    return work[0].shape[0]
