"""The decode queue: the audio decoding a scheduler iteration asked for, gathered and done
together on the model's thread, within the stall budget while rows wait, with bulk segments'
windows decoded in the streams' slack."""

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
    Each window is decoded whole, as when nobody listens: the same samples.

    While rows wait, a round keeps within ``budget`` (the scheduler's stall budget, seconds) as
    well: streams' chunks are decoded first come first, as many as fit at the measured cost of
    a round (``RoundCost``), one at least; the others wait for the next round, a step later,
    in their order. A stream's chunk is itself kept within the budget (``chunk_steps``)."""

    def __init__(self, decoder: AudioDecoder, on_run=None):
        self.decoder = decoder
        self.on_run = on_run  # on_run(items, seconds): the time spent decoding
        self.budget: float | None = None  # seconds a round may take while rows wait
        self._items: list[Item] = []
        self._new = 0  # of ``_items``, those asked for since the last round
        self._deferred: list[tuple[float, Item]] = []  # (since, item): bulk windows waiting
        self._chunks = RoundCost(FIRST_DECODE_PACE_SECONDS)  # streams' chunks, a round
        self._windows = RoundCost(FIRST_DECODE_PACE_SECONDS)  # whole windows, a round

    def __len__(self) -> int:
        """Items waiting for a round: asked for since the last one, or left by it."""
        return len(self._items)

    @property
    def pending(self) -> bool:
        """Work waiting for a later round: bulk windows waiting for streams to have time to
        spare, or streams' chunks left by the last round's budget."""
        return bool(self._deferred or self._items)

    def worth_joining(self) -> bool:
        """Whether a round runs this iteration with room in its budget: a stream's next chunk,
        asked for a little early, would share its fixed cost rather than wait a round."""
        if not self._new:
            return False
        if self.budget is None:
            return True
        steps = sum(_steps(work) for work, _, _ in self._items if isinstance(work, Advance))
        return self._chunks.seconds(steps) < self.budget

    def chunk_steps(self) -> int | None:
        """The most new steps a stream's chunk may take for its round to keep within the
        budget at the measured cost (None: no budget)."""
        if self.budget is None:
            return None
        return max(MIN_CHUNK_STEPS, self._chunks.steps_within(self.budget))

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
            self._new += 1

    def submit_stream(self, state, hiddens, until: int, final: bool, done, failed) -> None:
        """A stream's next chunk: ``AudioDecoder.advance_many`` on its steps so far."""
        self._items.append((Advance(state, hiddens, until, final), done, failed))
        self._new += 1

    def run(self, slack: float | None = None, budget: float | None = None) -> None:
        """Decode what was asked for, within ``budget`` (seconds; None: all of it, as when
        no row waits), and the deferred windows that ``slack`` and the budget allow (all of
        them with None)."""
        self.budget = budget
        items, spent = self._within(budget)
        now = time.monotonic()
        # the streams' spare time, and while they generate what is left of the budget
        limit = slack if slack is None or budget is None else min(slack, budget - spent)
        while self._deferred:
            since, item = self._deferred[0]
            cost = self._windows.seconds(_steps(item[0]))
            overdue = now - since >= MAX_DEFER_SECONDS
            if limit is not None and cost > limit and not overdue:
                break
            self._deferred.pop(0)
            items.append(item)
            if limit is not None:
                limit -= cost
                if overdue:
                    limit = min(limit, 0.0)  # one overdue window a round
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
            if self.on_run is not None:
                self.on_run(len(items), time.perf_counter() - started)
        for (_, done, failed), samples in zip(items, decoded, strict=True):
            try:
                done(samples)
            except Exception as error:  # the item's own failure, not its neighbours'
                failed(error)

    def _within(self, budget: float | None) -> tuple[list[Item], float]:
        """This round's items and their estimated seconds: every window asked for, and the
        streams' chunks in their order as far as the budget allows (one at least, and one of
        a stream a round: its chunks feed one state in turn); the rest wait, in order."""
        taken: list[Item] = []
        left: list[Item] = []
        states: set[int] = set()
        chunk_steps = window_steps = 0
        for item in self._items:
            work = item[0]
            if not isinstance(work, Advance):
                taken.append(item)
                window_steps += _steps(work)
                continue
            fits = budget is None or self._chunks.seconds(chunk_steps + _steps(work)) <= budget
            if left or (states and (id(work.state) in states or not fits)):
                left.append(item)
                continue
            taken.append(item)
            states.add(id(work.state))
            chunk_steps += _steps(work)
        self._items, self._new = left, 0
        spent = (self._chunks.seconds(chunk_steps) if chunk_steps else 0.0) + (
            self._windows.seconds(window_steps) if window_steps else 0.0
        )
        return taken, spent

    def _decode(self, work: list) -> list[np.ndarray]:
        """Windows through ``decode_many`` and streams' chunks through ``advance_many``, the
        results in the order of ``work``."""
        chunks = [index for index, item in enumerate(work) if isinstance(item, Advance)]
        windows = [index for index, item in enumerate(work) if not isinstance(item, Advance)]
        results: list[np.ndarray | None] = [None] * len(work)
        for indices, decode, cost in (
            (windows, self.decoder.decode_many, self._windows),
            (chunks, self.decoder.advance_many, self._chunks),
        ):
            if indices:
                steps = sum(_steps(work[i]) for i in indices)  # before ``advance_many`` feeds
                started = time.perf_counter()
                decoded = decode([work[i] for i in indices])
                cost.observe(steps, time.perf_counter() - started)
                for index, samples in zip(indices, decoded, strict=True):
                    results[index] = samples
        return every_one(results)


class RoundCost:
    """A decode round's seconds as a fixed part and a part a step, fitted by least squares to
    the rounds seen (each older round weighing ``MEMORY`` times less), so a round's size can be
    chosen by the time it takes on this CPU, as busy as it is now. Until rounds of different
    sizes have been seen, the time is taken as proportional to the steps."""

    MEMORY = 0.9

    def __init__(self, per_step: float):
        self.per_step, self.fixed = per_step, 0.0
        self._sums = [0.0] * 5  # weighted: rounds, steps, seconds, steps², steps * seconds

    def observe(self, steps: int, seconds: float) -> None:
        if steps <= 0:
            return
        values = (1.0, steps, seconds, steps * steps, steps * seconds)
        self._sums = [self.MEMORY * total + value for total, value in zip(self._sums, values)]
        rounds, x, y, xx, xy = self._sums
        spread = rounds * xx - x * x
        if spread > 1e-6 * rounds * xx:
            per_step = (rounds * xy - x * y) / spread
            fixed = (y - per_step * x) / rounds
            if per_step > 0 and fixed >= 0:
                self.per_step, self.fixed = per_step, fixed
                return
        self.per_step, self.fixed = y / x, 0.0

    def seconds(self, steps: int) -> float:
        return self.fixed + self.per_step * steps

    def steps_within(self, seconds: float) -> int:
        return int((seconds - self.fixed) / self.per_step)


# A bulk window waits at most this long for the streams to spare the time to decode it, and a
# round's time is estimated at this pace (seconds a step) until rounds have been timed.
MAX_DEFER_SECONDS = 2.0
FIRST_DECODE_PACE_SECONDS = 0.0005
# A stream's chunk is never cut below this many new steps to fit the budget: a round's fixed
# cost would then outweigh its audio (``chunk_steps``).
MIN_CHUNK_STEPS = 12


def _steps(work) -> int:
    """The steps an item's decode reads: a stream chunk's new ones, a window's all."""
    if isinstance(work, Advance):
        return max(0, work.hiddens.shape[0] - work.state.fed)
    return work[0].shape[0]
