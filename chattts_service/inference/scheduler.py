"""One thread that owns the model and batches every request's generation.

All heavy torch work runs on this one thread: loading, prompts, decode steps and audio decoding.
(The same decode step is much slower when torch's OpenMP work is spread over several Python
threads, even when only one of them is busy at a time.) Other threads hand it
work with ``call`` (run a function between two steps) or ``submit`` (a synthesis job).

Request threads ``submit`` a job and wait on its future. The scheduler thread takes jobs from a
queue bounded by the batching policy: when idle it waits up to ``batch_wait_ms`` for up to
``max_batch`` jobs to start together; while a batch runs, queued jobs join it between two steps
(continuous batching) as long as rows and the KV-cache budget allow. A job whose worst-case KV
cache does not fit waits in the queue rather than letting memory grow past the budget.

Which job gets a row, and when a waiting one takes a running one's row, is ``fairness``'s
policy (classes, shares per key and request, the bulk floor). A sequence that gives its row up
is paused with its KV cache and resumes where it was. Nothing holds the running rows for much
longer than the policy's ``stall_budget_ms`` between two steps: while rows step, prompts are
prefilled a piece at a time (where the kernels run the layers), as many positions as fit what
the decode round before them left of the budget at the measured pace; the gaps between steps
are timed (``on_stall``).

A job is a small state machine supplied by the engine: ``start()`` gives its first sequence,
``advance(sequence)`` either gives the next one (text refinement, then speech) or finishes the
job. Any failure fails that job alone; the thread never dies with a request. Longer than most
modules: admission, taking rows back, prefill pieces and steps all work on the same batch and
owners from the one thread, and split apart each would reach into the others.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, TypeGuard

from chattts_service.domain.speech import BULK, INTERACTIVE
from chattts_service.inference.fairness import (
    Holdings,
    Share,
    next_share,
    victim,
)
from chattts_service.inference.policy import BatchingPolicy

if TYPE_CHECKING:  # the batch brings torch, which the API layer does not need to import
    from chattts_service.inference.decode_queue import DecodeQueue
    from chattts_service.inference.generation import Batch, Sequence

log = logging.getLogger(__name__)

# A prefill piece is at least this many positions (a piece reads every weight once: fewer
# positions would cost that read for little), and the first piece assumes this pace (seconds a
# position) until pieces have been timed.
MIN_PIECE = 16
FIRST_PACE_SECONDS = 0.001
# A piece aims at this share of the time left: a piece's pace varies by a tenth or two from the
# last one's (a recorded voice's sample grows slower as the pieces reach further in).
PIECE_MARGIN = 0.85
# A stream whose listener holds less than its low water by this much is short: bulk gives rows
# up for it as for a stream starting (its chunks come a low water ahead, so a healthy stream
# dips below its low water only until its next chunk)
SHORT_SECONDS = 0.3


class QueueFull(Exception):
    """The request queue is at its bound; the caller should retry later."""


class JobCancelled(Exception):
    """The job was dropped because its caller asked to stop it."""


class JobFuture(Future):
    """A job's future; ``cancel`` also stops a job that is already generating."""

    def __init__(self):
        super().__init__()
        self.stop_requested = False

    def cancel(self) -> bool:
        self.stop_requested = True
        return super().cancel()  # True only while still queued


class Job(Protocol):
    future: JobFuture

    def start(self) -> Sequence: ...

    def advance(self, finished: Sequence) -> Sequence | None: ...

    # optional: ``progress(sequence, joining)`` is called after every step the job's sequence
    # takes, and says whether it asked for audio to be decoded (``joining``: a decode runs anyway)


class StreamJob(Job, Protocol):
    """A streamed job: its audio goes to a listener chunk by chunk."""

    chunks: object

    def slack(self) -> float | None: ...


class Scheduler:
    def __init__(
        self,
        policy: BatchingPolicy,
        on_step: Callable[[int, float], None] | None = None,
        on_prefill: Callable[[int, float], None] | None = None,
        on_stall: Callable[[float], None] | None = None,
        on_admitted: Callable[[str, float], None] | None = None,
        on_taken_back: Callable[[str], None] | None = None,
    ):
        self.batch: Batch | None = None  # attached from the model thread once loaded
        self.decodes: DecodeQueue | None = None
        self.policy = policy
        self.kv_budget_positions = 0
        # jobs not started yet, in arrival order; ``submit`` holds them to the policy's bound,
        # which may change at run time
        self._queued: list[Job] = []
        self._submit_lock = threading.Lock()
        self._arrivals = itertools.count()
        self._shares: dict[Job, Share] = {}  # every job's place in the policy, from its submit
        self._submitted: dict[Job, float] = {}  # when each job not yet given a row came
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        # started, not stepping: new (no row yet) or paused (their row taken back)
        self._waiting: list[tuple[Job, Sequence]] = []
        self._owners: dict[Sequence, Job] = {}  # the job of every sequence waiting or generating
        self._on_step = on_step  # on_step(rows, seconds) after every step
        # on_prefill(positions, seconds) after every prompt's prefill (its pieces summed)
        self._on_prefill = on_prefill
        self._on_stall = on_stall  # on_stall(seconds): a gap between two steps of a batch
        self._on_admitted = on_admitted  # on_admitted(priority, seconds queued): a first row
        self._on_taken_back = on_taken_back  # on_taken_back(priority): the taker's class
        # each prompt part-way in: the seconds its pieces took so far, its last piece's pace
        # (seconds a position; None if it took no position)
        self._prefilling: dict[Sequence, tuple[float, float | None]] = {}
        self._passed_over: set[Sequence] = set()  # prompts given no piece last iteration
        self._seconds_per_position: float | None = None  # the recent pace of prefill pieces
        self._last_step_end: float | None = None
        self._pieces = 0  # prefill pieces in this iteration
        self.preempted = 0  # rows taken back so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def attach(
        self, batch: Batch, kv_budget_positions: int, decodes: DecodeQueue | None = None
    ) -> None:
        """``decodes``: the ``DecodeQueue`` jobs hand their audio to, run once per iteration."""
        self.batch = batch
        self.kv_budget_positions = kv_budget_positions
        self.decodes = decodes

    @property
    def _batch(self) -> Batch:
        """The attached batch: the scheduler's thread works on it only once attached."""
        batch = self.batch
        if batch is None:
            raise RuntimeError("no model attached")
        return batch

    def call(self, function: Callable[[], object]) -> Future:
        """Run ``function`` on the scheduler thread between two steps."""
        future: Future = Future()
        self._calls.put((function, future))
        self._wakeup.set()
        return future

    def submit(self, job: Job) -> Future:
        """Queue a job. Its ``placement`` (class, API key, request, index in the request; see
        ``fairness.Share``), when it has one, gives its place; else it is interactive and a
        request of its own."""
        if self.batch is None:
            raise RuntimeError("no model attached")
        placement: tuple[str, str | None, int, int] = getattr(job, "placement", None) or (
            INTERACTIVE,
            None,
            id(job),
            0,
        )
        with self._submit_lock:
            if len(self._queued) >= self.policy.max_queue:
                raise QueueFull(f"{self.policy.max_queue} requests already queued")
            priority, tenant, request, index = placement
            self._shares[job] = Share(priority, tenant, request, index, next(self._arrivals))
            self._submitted[job] = time.perf_counter()
            self._queued.append(job)
        self._wakeup.set()
        return job.future

    def policy_changed(self) -> None:
        """Wake the thread so a tuned policy takes effect between two steps."""
        self._wakeup.set()

    def free_queue_slots(self) -> int:
        return max(0, self.policy.max_queue - len(self._queued))

    @property
    def depth(self) -> int:
        """Jobs queued or waiting for room, plus those generating or being prefilled."""
        batch = self.batch
        running = len(batch) + len(batch.filling) if batch is not None else 0
        return len(self._queued) + len(self._waiting) + running

    # -- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._run_calls()
                if self._idle() and not self._wait_for_work():
                    continue
                self._drop_cancelled()
                self._admit()
                if len(self._batch):
                    self._step()
                elif not self._paused():
                    self._last_step_end = None  # no rows wait on what comes next
                if self.decodes is not None:
                    # what the jobs asked for in this iteration, together; bulk segments'
                    # audio when the streams can spare the time; within the stall budget
                    # while rows step or work waits for a row, half of it while a prefill is
                    # under way (its next piece comes before the next step, in the same budget)
                    # unless a listener holds less than its low water
                    # less what a prompt passed over will take in its piece after it
                    slacks = self._stream_slacks()
                    budget = None
                    piece = self._passed_over_piece()
                    if len(self._batch) or self._waiting or self._queued:
                        budget = self._stall_budget
                        low = any(slack is not None and slack < 0 for slack in slacks)
                        if self._batch.filling and not low:
                            budget /= 2
                        budget = max(0.0, min(budget, self._stall_budget - piece))
                    starting = None in slacks
                    self.decodes.run(self._decode_slack(slacks), budget, starting, piece > 0)
            except Exception:  # pragma: no cover - a bug: fail what is running, keep serving
                log.exception("scheduler iteration failed; failing the running jobs")
                self._fail_all(RuntimeError("internal error in the scheduler"))

    def _run_calls(self) -> None:
        while True:
            try:
                function, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function())
            except BaseException as error:  # handed to the caller, who re-raises it
                future.set_exception(error)

    def _idle(self) -> bool:
        batch = self.batch
        if batch is None:
            return True
        decoding = self.decodes is not None and self.decodes.pending
        return not (len(batch) or batch.filling or self._waiting or self._queued or decoding)

    def _stream_slacks(self) -> list[float | None]:
        """``job.slack()`` of every stream generating (None: before its first audio)."""
        jobs = (self._owners[sequence] for sequence in self._batch.active)
        return [job.slack() for job in jobs if _is_stream(job)]

    def _paused(self) -> bool:
        """Whether a sequence waits paused (its row taken back, its KV cache kept)."""
        return bool(self._paused_work())

    def _paused_work(self) -> list[tuple[Job, Sequence]]:
        """The waiting work that is paused (its KV cache kept), in waiting order."""
        return [(job, sequence) for job, sequence in self._waiting if sequence.cache is not None]

    def _decode_slack(self, slacks: list[float | None]) -> float | None:
        """The seconds a decode round may take beyond what the streams ask for: the least
        audio a stream holds beyond its low water (``job.slack``, of ``slacks``); 0 while a
        stream waits for its first audio (the round would add its time to that wait); None
        (no bound) where no stream generates."""
        if not slacks:
            return None
        if None in slacks:
            return 0.0
        return max(0.0, min(slack for slack in slacks if slack is not None))

    @property
    def _stall_budget(self) -> float:
        return self.policy.stall_budget_ms / 1000.0

    def _wait_for_work(self) -> bool:
        """Idle: wait for a job (or a call), then up to ``batch_wait_ms`` for more to start
        together; whether there is work to admit."""
        # cleared before looking, so whatever arrives after the look sets it again and the wait
        # ends at once
        self._wakeup.clear()
        if not self._queued and self._calls.empty() and not self._stop.is_set():
            self._wakeup.wait(0.5)
        if self.batch is None or not self._queued:
            return False
        until = time.monotonic() + self.policy.batch_wait_seconds
        while len(self._queued) < self.policy.max_batch and not self._stop.is_set():
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            self._wakeup.clear()
            self._wakeup.wait(remaining)
        return True

    # -- who gets a row ------------------------------------------------------------------------

    def _admit(self) -> None:
        """Give rows to waiting work in the policy's order, taking rows back where it says so,
        and prefill: while rows step, pieces until the stall budget is spent; with none
        stepping, every prompt whole (nobody waits on it, and work that arrives together
        starts together: streams then share their decode rounds from the first), but bulk
        prompts in pieces once an interactive row is ready (it waits on them)."""
        batch = self._batch
        bulk_cap = self._bulk_cap()
        if bulk_cap is not None:
            while self._take_row_for(None, bulk_cap):
                pass
        if not len(batch) and self._paused():
            # every stepping row has ended while others wait paused: they resume first (no
            # prefill), rather than wait with nothing stepping while a prompt goes in pieces
            self._give_rows(bulk_cap, None, time_left=False)
        deadline = None
        if len(batch):  # the rows waited since the last step, decoding included
            deadline = (self._last_step_end or time.perf_counter()) + self._stall_budget
        elif self._paused():  # paused rows wait, but nothing steps that a piece would stall
            deadline = time.perf_counter() + self._stall_budget
        self._pieces = 0
        self._passed_over &= set(batch.filling)
        # prefills under way hold their rows: they go on first
        time_left = all(self._fill(sequence, deadline) for sequence in list(batch.filling))
        self._give_rows(bulk_cap, deadline, time_left)

    def _give_rows(self, bulk_cap: int | None, deadline: float | None, time_left: bool) -> None:
        """Rows to the waiting work in the policy's order, prefilling what starts (pieces
        until ``deadline``); once no time is left, only paused rows resume (no prefill: it
        costs the rows nothing)."""
        batch = self._batch
        while True:
            chosen = self._choose(paused_only=not time_left)
            if chosen is None:
                return
            job, sequence = chosen
            if _is_stream(job) and bulk_cap is None:  # it may have come since the cap was set
                bulk_cap = self._bulk_cap()
            if self._shares[job].priority == BULK and deadline is None and self._ready_waits():
                # nothing stepped yet, but a row someone waits on can: a bulk prompt beside it
                # goes in pieces, as it would beside stepping rows
                deadline = time.perf_counter() + self._stall_budget
            if bulk_cap is not None and self._shares[job].priority == BULK:
                held = Holdings(self._running_shares(batch.active + batch.filling))
                if held.by_priority[BULK] >= bulk_cap:
                    return  # a listener waits for its first audio: bulk waits with it
            if not self._has_room(sequence):
                if not self._take_row_for(job):
                    return  # the best waiting one cannot run yet: nothing overtakes it
                continue
            self._waiting.remove(chosen)
            self._admitted(job)
            if sequence.cache is not None and sequence.filling is None:  # paused: no prefill
                batch.resume(sequence)
                continue
            try:
                batch.begin(sequence)
            except Exception as error:
                log.exception("prefill failed")
                del self._owners[sequence]
                job.future.set_exception(error)
                continue
            time_left = self._fill(sequence, deadline)

    def _ready_waits(self) -> bool:
        """Whether an interactive row is ready to step (its prompt in)."""
        return any(
            self._shares[self._owners[sequence]].priority == INTERACTIVE
            for sequence in self._batch.active
        )

    def _choose(self, paused_only: bool = False) -> tuple[Job, Sequence] | None:
        """The waiting work that gets the next row, started if it was only queued (its prompt
        built: what it needs of the KV cache is known then); ``paused_only``: of the paused."""
        while True:
            with self._submit_lock:
                queued = [] if paused_only else list(self._queued)
            waiting = self._paused_work() if paused_only else list(self._waiting)
            candidates = [(job, None) for job in queued] + waiting
            running = self._running_shares(self._batch.active + self._batch.filling)
            batch = self._batch
            free = min(batch.free_rows, self.policy.max_batch - len(batch) - len(batch.filling))
            index = next_share(
                [self._shares[job] for job, _ in candidates],
                running,
                self.policy.bulk_min_rows,
                max(1, free),
            )
            if index is None:
                return None
            job, sequence = candidates[index]
            if sequence is not None:
                return job, sequence
            with self._submit_lock:
                self._queued.remove(job)
            self._start_job(job)  # into ``_waiting``, or failed: choose again

    def _running_shares(self, sequences) -> list[Share]:
        return [self._shares[self._owners[sequence]] for sequence in sequences]

    def _has_room(self, sequence: Sequence) -> bool:
        batch = self._batch
        if not batch.free_rows or len(batch) + len(batch.filling) >= self.policy.max_batch:
            return False
        if not (len(batch) or batch.filling):
            return True
        paused = sum(
            other.held_positions()
            for _, other in self._waiting
            if other.cache is not None and other is not sequence
        )
        need = batch.reserved_positions() + paused + sequence.kv_positions()
        return need <= self.kv_budget_positions

    def _take_row_for(self, job: Job | None, bulk_floor: int | None = None) -> bool:
        """Pause the stepping sequence ``job`` outranks (``fairness.victim``), if any; with
        no job, a bulk row above ``bulk_floor`` (for a stream starting)."""
        active = self._batch.active
        floor = self.policy.bulk_min_rows if bulk_floor is None else bulk_floor
        if job is None:
            taker = Share(INTERACTIVE, None, -1, 0, -1)
        else:
            taker, floor = self._shares[job], self.policy.bulk_min_rows
        index = victim(taker, self._running_shares(active), floor)
        if index is None:
            return False
        sequence = active[index]
        self._batch.pause(sequence)
        self._waiting.append((self._owners[sequence], sequence))
        self.preempted += 1
        if self._on_taken_back is not None:
            self._on_taken_back(taker.priority)
        return True

    def _bulk_cap(self) -> int | None:
        """The rows bulk may hold now: ``bulk_rows_while_starting`` (at least its floor) while
        an interactive stream waits for its first audio, or its listener holds less than its
        low water by ``SHORT_SECONDS``: more rows would slow its steps; else no cap (None)."""
        batch = self._batch
        with self._submit_lock:
            queued = list(self._queued)
        jobs = [*queued, *(self._owners[s] for s in (*batch.active, *batch.filling))]
        jobs += [job for job, sequence in self._waiting if sequence.cache is None]
        for job in jobs:
            if _is_stream(job) and self._shares[job].priority == INTERACTIVE:
                slack = job.slack()
                if slack is None or slack < -SHORT_SECONDS:
                    return max(self.policy.bulk_min_rows, self.policy.bulk_rows_while_starting)
        return None

    def _admitted(self, job: Job) -> None:
        submitted = self._submitted.pop(job, None)
        if submitted is not None and self._on_admitted is not None:
            self._on_admitted(self._shares[job].priority, time.perf_counter() - submitted)

    def _start_job(self, job: Job) -> None:
        if job.future.cancelled() or not job.future.set_running_or_notify_cancel():
            self._forget(job)
            return
        if job.future.stop_requested:
            job.future.set_exception(JobCancelled("cancelled before it started"))
            self._forget(job)
            return
        try:
            sequence = job.start()
        except Exception as error:
            job.future.set_exception(error)
            self._forget(job)
            return
        self._owners[sequence] = job
        self._waiting.append((job, sequence))

    def _forget(self, job: Job) -> None:
        self._shares.pop(job, None)
        self._submitted.pop(job, None)

    def _fill(self, sequence: Sequence, deadline: float | None) -> bool:
        """Prefill ``sequence``'s prompt: all of it with no ``deadline``, else piece by piece
        until it is in or the deadline passes; whether time is left for more work."""
        while sequence.filling is not None:
            if deadline is not None and not self._piece_goes(sequence, deadline):
                self._passed_over.add(sequence)
                return False
            self._passed_over.discard(sequence)
            self._fill_piece(sequence, deadline)
            self._pieces += 1
            if deadline is not None and time.perf_counter() >= deadline:
                return False
        return True

    def _piece_goes(self, sequence: Sequence, deadline: float) -> bool:
        """Whether ``sequence`` gets a piece now: ``MIN_PIECE`` of its positions fit before
        ``deadline``, or it is the first prompt this iteration and was passed over in the
        last one (a prefill never starves behind decode rounds that spend the budget)."""
        if time.perf_counter() + MIN_PIECE * self._pace(sequence) <= deadline:
            return True
        return not self._pieces and sequence in self._passed_over

    def _passed_over_piece(self) -> float:
        """The seconds the piece of a prompt passed over (it goes first in the next iteration,
        whatever time is left) will take at its pace; 0 if none was."""
        waiting = [sequence for sequence in self._batch.filling if sequence in self._passed_over]
        return MIN_PIECE * self._pace(waiting[0]) / PIECE_MARGIN if waiting else 0.0

    def _pace(self, sequence: Sequence) -> float:
        """Seconds a position of ``sequence``'s next piece: its last piece's (a recorded
        voice's sample grows slower as the piece reaches further in), else the recent pace."""
        _, pace = self._prefilling.get(sequence, (0.0, None))
        return pace or self._seconds_per_position or FIRST_PACE_SECONDS

    def _fill_piece(self, sequence: Sequence, deadline: float | None) -> None:
        """One piece: as many positions as the time left allows at the prompt's pace (at
        least ``MIN_PIECE``; all of them with no ``deadline``); a failure fails its job
        alone."""
        limit = None
        if deadline is not None and self._batch.transformer.prefills_in_pieces:
            left = PIECE_MARGIN * (deadline - time.perf_counter())
            limit = max(MIN_PIECE, int(left / self._pace(sequence)))
        started = time.perf_counter()
        try:
            positions = self._batch.fill(sequence, limit)
        except Exception as error:
            log.exception("prefill failed")
            self._batch.remove([sequence])
            self._prefilling.pop(sequence, None)
            job = self._owners.pop(sequence)
            self._forget(job)
            job.future.set_exception(error)
            return
        seconds = time.perf_counter() - started
        spent, pace = self._prefilling.pop(sequence, (0.0, None))
        spent += seconds
        if positions:
            pace = seconds / positions
            previous = self._seconds_per_position
            self._seconds_per_position = pace if previous is None else 0.7 * previous + 0.3 * pace
        if sequence.filling is not None:  # more pieces to come
            self._prefilling[sequence] = (spent, pace)  # a piece of no position: the last pace
            return
        if self._on_prefill is not None:
            self._on_prefill(sequence.prompt.shape[0], spent)
        if sequence.finished:  # done at its first token: hand over to the job's next stage
            self._advance(sequence)

    # -- steps ---------------------------------------------------------------------------------

    def _step(self) -> None:
        rows = len(self._batch)
        started = time.perf_counter()
        if self._last_step_end is not None and self._on_stall is not None:
            self._on_stall(started - self._last_step_end)
        try:
            finished = self._batch.step()
        except Exception as error:
            log.exception("decode step failed")
            self._fail_all(error)
            return
        if self._on_step is not None:
            self._on_step(rows, time.perf_counter() - started)
        for sequence in finished:
            self._advance(sequence)
        not_yet = []
        for sequence in self._batch.active:
            if not self._progress(sequence, joining=False):
                not_yet.append(sequence)
        if self.decodes is not None and len(self.decodes):  # e.g. streams' chunks worth joining
            for sequence in not_yet:
                self._progress(sequence, joining=True)
        # rows paused for others wait for the next step too
        self._last_step_end = time.perf_counter() if len(self._batch) or self._paused() else None

    def _progress(self, sequence: Sequence, joining: bool) -> bool:
        """The job's ``progress`` (e.g. a stream asks for its next chunk); whether it asked
        for audio."""
        job = self._owners[sequence]
        progress = getattr(job, "progress", None)
        if progress is None:
            return False
        try:
            return bool(progress(sequence, joining))
        except Exception as error:
            log.exception("job progress failed")
            job.future.stop_requested = True  # leaves the batch before the next step
            if not job.future.done():
                job.future.set_exception(error)
            return False

    def _drop_cancelled(self) -> None:
        """Work whose caller gave up (deadline passed, client left) stops costing steps and
        memory: stepping, being prefilled, paused or only queued."""
        batch = self._batch
        leaving = [
            sequence
            for sequence in (*batch.active, *batch.filling)
            if self._owners[sequence].future.stop_requested
        ]
        for sequence in batch.remove(leaving):
            self._prefilling.pop(sequence, None)
            self._advance(sequence)
        gone = [entry for entry in self._waiting if entry[0].future.stop_requested]
        for entry in gone:
            self._waiting.remove(entry)
            entry[1].cache = None
            self._advance(entry[1])
        with self._submit_lock:
            dropped = [job for job in self._queued if job.future.stop_requested]
            for job in dropped:
                self._queued.remove(job)
        for job in dropped:
            self._start_job(job)  # fails it as cancelled before it started

    def _advance(self, sequence: Sequence) -> None:
        job = self._owners.pop(sequence)
        if job.future.stop_requested:
            if not job.future.done():
                job.future.set_exception(JobCancelled("cancelled while generating"))
            self._forget(job)
            return
        try:
            following = job.advance(sequence)
        except Exception as error:
            job.future.set_exception(error)
            self._forget(job)
            return
        if following is None:
            self._forget(job)
            return
        self._owners[following] = job
        self._waiting.append((job, following))

    def _fail_all(self, error: Exception) -> None:
        batch = self.batch
        if batch is None:  # nothing attached: nothing runs
            return
        for sequence in batch.remove([*batch.active, *batch.filling]):
            self._prefilling.pop(sequence, None)
            job = self._owners.pop(sequence)
            self._forget(job)
            if not job.future.done():
                job.future.set_exception(error)


def _is_stream(job: Job) -> TypeGuard[StreamJob]:
    """A streamed job: its audio goes to a listener chunk by chunk (``SynthesisJob.chunks``)."""
    return getattr(job, "chunks", None) is not None
