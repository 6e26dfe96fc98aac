"""The decode queue: the audio decoding a scheduler iteration asked for, gathered and done
together on the model's thread, in rounds run a stage at a time within the stall budget while
rows wait (streams' chunks first, then windows), with bulk segments' windows decoded in the
streams' slack."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from chattts_service.inference.decoding import Advance, AudioDecoder, Round, Span

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
    anyway once the oldest has waited ``MAX_DEFER_SECONDS`` (``MAX_HOLD_SECONDS`` while a
    stream waits for its first audio, ``starting``: the window would add its whole time to
    that wait); ``slack`` None decodes them all.
    Each window is decoded whole, as when nobody listens: the same samples.

    Streams' chunks are decoded together as a ``Round``, every chunk waiting at the start of
    one in one batch a stage, and windows as rounds of their own (``decode_many``'s batches),
    with a budget as many windows a round as keep its longest stage within ``STAGE_SHARE`` of
    it at the measured pace (several bulk segments ending together made stages of 40-50 ms).
    With a ``budget`` (seconds: the scheduler's stall budget while rows step) rounds run a
    stage at a time, chunks' first, as many stages an iteration as fit the budget at the pace
    of the last one: their batches and samples are the same, their audio comes some steps
    later, and the rows wait no longer than the budget (where one round of many chunks, or a
    long window, held them hundreds of ms). Chunks run one stage an iteration at least;
    windows too once they have had none for ``MAX_DEFER_SECONDS``. Work asked for while a
    round of its kind runs waits for the next one, a stream's next chunk after its last."""

    def __init__(self, decoder: AudioDecoder, on_run=None):
        self.decoder = decoder
        self.on_run = on_run  # on_run(items, seconds): the time spent decoding
        self._items: list[Item] = []
        self._chunks = _Rounds(self._chunk_round)  # streams' chunks
        self._windows = _Rounds(self._window_round, self._windows_timed, self._window_stage)
        self._deferred: list[tuple[float, Item]] = []  # (since, item): bulk windows waiting
        self._seconds_per_step = FIRST_DECODE_PACE_SECONDS  # recent pace of a window, a step
        # recent pace of a window round's longest stage, a step of its windows; and the most a
        # stage of the next window round may take (None: no bound)
        self._stage_seconds_per_step = FIRST_DECODE_PACE_SECONDS
        self._stage_bound: float | None = None

    def __len__(self) -> int:
        """Items asked for and not yet decoding (a decode runs this iteration, or they wait
        for the next round of their kind)."""
        return len(self._items) + len(self._chunks.waiting) + len(self._windows.waiting)

    @property
    def pending(self) -> bool:
        """Work left for a later iteration: bulk windows waiting for streams to have time to
        spare, a round under way, or work waiting for the next."""
        return bool(self._deferred or self._chunks or self._windows)

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

    def run(
        self,
        slack: float | None = None,
        budget: float | None = None,
        starting: bool = False,
        piece_follows: bool = False,
    ) -> None:
        """Decode what was asked for and the deferred windows that ``slack`` allows (all of
        them with None; ``starting``: a stream waits for its first audio): with a ``budget``,
        stages of rounds until it is spent (see the class); without, every round to its end.
        ``piece_follows``: a prefill piece comes after this round whatever time it leaves (the
        budget is what the piece leaves): windows then start no stage past the budget unless
        they have had none for ``MAX_DEFER_SECONDS``."""
        started = time.perf_counter()
        items, self._items = self._items, []
        self._chunks.waiting += [item for item in items if isinstance(item[0], Advance)]
        windows = [item for item in items if not isinstance(item[0], Advance)]
        now = time.monotonic()
        while self._deferred:
            since, item = self._deferred[0]
            cost = self._seconds_per_step * _steps(item[0])
            overdue = now - since >= (MAX_HOLD_SECONDS if starting else MAX_DEFER_SECONDS)
            if slack is not None and cost > slack and not overdue:
                break
            self._deferred.pop(0)
            windows.append(item)
            if slack is not None:
                slack -= cost
                if overdue:
                    slack = min(slack, 0.0)  # one overdue window a round
        self._windows.waiting += windows
        deadline = None if budget is None else started + budget
        self._stage_bound = None if budget is None else STAGE_SHARE * budget
        chunks, ran = bool(self._chunks), bool(self._chunks or self._windows)
        delivered = self._chunks.run(deadline, at_least_one=True) if chunks else 0
        if self._windows:
            starved = self._windows.since_stage(time.perf_counter()) >= MAX_DEFER_SECONDS
            forced = starved or not (chunks or piece_follows)
            delivered += self._windows.run(deadline, at_least_one=forced)
        if ran and self.on_run is not None:
            self.on_run(delivered, time.perf_counter() - started)

    def _chunk_round(self, waiting: list[Item]) -> tuple[Round, list[Item], list[Item]]:
        """A round of the chunks waiting, in order, one a stream (a stream's later chunk waits
        for the round after its earlier one): the round, its items, those left waiting."""
        taken: list[Item] = []
        left: list[Item] = []
        states: set[int] = set()
        advances: list[Advance] = []
        for item in waiting:
            work = item[0]
            assert isinstance(work, Advance)  # only streams' chunks
            if id(work.state) in states:
                left.append(item)
            else:
                taken.append(item)
                advances.append(work)
            states.add(id(work.state))
        return self.decoder.advancing(advances), taken, left

    def _window_round(self, waiting: list[Item]) -> tuple[Round, list[Item], list[Item]]:
        """A round of the windows waiting, in order (``decode_many``'s batches): as many as
        keep its longest stage, at the measured pace, within the stage bound (one at least),
        so a stage of many windows ending together does not hold the rows for tens of ms."""
        taken, steps, bound = 0, 0, self._stage_bound
        for work, _, _ in waiting:
            steps += _steps(work)
            if taken and bound is not None and steps * self._stage_seconds_per_step > bound:
                break
            taken += 1
        spans = [work for work, _, _ in waiting[:taken] if not isinstance(work, Advance)]
        return self.decoder.decoding(spans), waiting[:taken], waiting[taken:]

    def _window_stage(self, items: list[Item]) -> float:
        """The seconds a stage of a window round of ``items`` may take: its longest, at the
        measured pace."""
        return self._stage_seconds_per_step * _all_steps(items)

    def _windows_timed(self, items: list[Item], seconds: float, longest: float) -> None:
        steps = _all_steps(items)
        if steps:
            self._seconds_per_step = 0.8 * self._seconds_per_step + 0.2 * seconds / steps
            pace = self._stage_seconds_per_step
            self._stage_seconds_per_step = 0.8 * pace + 0.2 * longest / steps


class _Rounds:
    """One kind of decoding as rounds, one under way at a time: ``waiting`` items go into the
    next round ``start(waiting)`` makes; ``timed(items, seconds, longest)`` when a round has
    ended (its time in all, and its longest stage's); ``estimate(items)``, if given, the
    seconds a stage of a round of ``items`` may take (a stage starts only if that fits)."""

    def __init__(self, start, timed=None, estimate=None):
        self.waiting: list[Item] = []
        self._start, self._timed, self._estimate = start, timed, estimate
        self._under_way: tuple[Round, list[Item]] | None = None
        self._spent = 0.0  # seconds the round under way has taken so far
        self._longest = 0.0  # and its longest stage
        self._last_stage = time.perf_counter()

    def __bool__(self) -> bool:
        return bool(self.waiting or self._under_way)

    def since_stage(self, now: float) -> float:
        return now - self._last_stage

    def run(self, deadline: float | None, at_least_one: bool) -> int:
        """Stages of the round under way, then of new ones, until ``deadline`` would pass
        (None: to the end of everything waiting; ``at_least_one``: a stage even past it); the
        items delivered."""
        delivered = 0
        while True:
            began = time.perf_counter()
            if deadline is not None and not at_least_one and began + self._next() >= deadline:
                return delivered
            at_least_one = False
            if self._under_way is None:
                if not self.waiting:
                    return delivered
                work, items, self.waiting = self._start(self.waiting)
                self._under_way, self._spent, self._longest = (work, items), 0.0, 0.0
            work, items = self._under_way
            try:
                finished = work.run_stage()
            except Exception as error:  # the round's items fail; the thread goes on
                self._under_way = None
                for _, _, failed in items:
                    failed(error)
                continue
            end = self._last_stage = time.perf_counter()
            self._spent += end - began
            self._longest = max(self._longest, end - began)
            if finished:
                self._under_way = None
                if self._timed is not None:
                    self._timed(items, self._spent, self._longest)
                _deliver(items, work.results)
                delivered += len(items)
            if deadline is not None and end + (end - began) > deadline:
                return delivered

    def _next(self) -> float:
        """The seconds the next stage may take (0 where unknown): of the round under way, or
        of one with the first item waiting."""
        if self._estimate is None:
            return 0.0
        if self._under_way is not None:
            return self._estimate(self._under_way[1])
        return self._estimate(self.waiting[:1]) if self.waiting else 0.0


def _deliver(items: list[Item], decoded: list[np.ndarray]) -> None:
    """Each item's ``done(samples)``, in order; a failing one calls its own ``failed``."""
    for (_, done, failed), samples in zip(items, decoded, strict=True):
        try:
            done(samples)
        except Exception as error:  # the item's own failure, not its neighbours'
            failed(error)


# A bulk window waits at most this long for the streams to spare the time to decode it (at
# most MAX_HOLD_SECONDS while a stream waits for its first audio: streams start every few
# seconds on a busy box, and bulk's audio must come), and a round's time is estimated at this
# pace (seconds a step) until rounds have been timed.
MAX_DEFER_SECONDS = 2.0
MAX_HOLD_SECONDS = 6.0
FIRST_DECODE_PACE_SECONDS = 0.0005
# With a budget, a stage of a window round aims at this share of it: a prefill piece may come
# after it in the same gap between steps.
STAGE_SHARE = 0.5


def _steps(work) -> int:
    """The steps a window's decode reads: all of them."""
    return work[0].shape[0]


def _all_steps(items: list[Item]) -> int:
    """The steps the windows of ``items`` read together."""
    return sum(_steps(work) for work, _, _ in items)
