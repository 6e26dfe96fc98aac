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

A job is a small state machine supplied by the engine: ``start()`` gives its first sequence,
``advance(sequence)`` either gives the next one (text refinement, then speech) or finishes the
job. Any failure fails that job alone; the thread never dies with a request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

from chattts_service.inference.policy import BatchingPolicy

if TYPE_CHECKING:  # the batch brings torch, which the API layer does not need to import
    from chattts_service.inference.generation import Batch, Sequence

log = logging.getLogger(__name__)


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


class Scheduler:
    def __init__(
        self,
        policy: BatchingPolicy,
        on_step: Callable[[int, float], None] | None = None,
        on_prefill: Callable[[int, float], None] | None = None,
    ):
        self.batch: Batch | None = None  # attached from the model thread once loaded
        self.decodes = None
        self.policy = policy
        self.kv_budget_positions = 0
        # unbounded: ``submit`` holds it to the policy's bound, which may change at run time
        self._queue: queue.Queue = queue.Queue()
        self._submit_lock = threading.Lock()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._waiting: list[tuple[Job, Sequence]] = []  # started, but no room in the batch yet
        self._owners: dict[Sequence, Job] = {}  # the job of every sequence waiting or generating
        self._on_step = on_step  # on_step(rows, seconds) after every step
        # on_prefill(positions, seconds) after every prompt's prefill (every row waits for it)
        self._on_prefill = on_prefill
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def attach(self, batch: Batch, kv_budget_positions: int, decodes=None) -> None:
        """``decodes``: the ``DecodeQueue`` jobs hand their audio to, run once per iteration."""
        self.batch = batch
        self.kv_budget_positions = kv_budget_positions
        self.decodes = decodes

    def call(self, function: Callable[[], object]) -> Future:
        """Run ``function`` on the scheduler thread between two steps."""
        future: Future = Future()
        self._calls.put((function, future))
        self._wakeup.set()
        return future

    def submit(self, job: Job) -> Future:
        if self.batch is None:
            raise RuntimeError("no model attached")
        with self._submit_lock:
            if self._queue.qsize() >= self.policy.max_queue:
                raise QueueFull(f"{self.policy.max_queue} requests already queued")
            self._queue.put_nowait(job)
        self._wakeup.set()
        return job.future

    def policy_changed(self) -> None:
        """Wake the thread so a tuned policy takes effect between two steps."""
        self._wakeup.set()

    def free_queue_slots(self) -> int:
        return max(0, self.policy.max_queue - self._queue.qsize())

    @property
    def depth(self) -> int:
        """Jobs queued or waiting for room, plus those generating."""
        running = len(self.batch) if self.batch is not None else 0
        return self._queue.qsize() + len(self._waiting) + running

    # -- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._run_calls()
                if self.batch is None or (not len(self.batch) and not self._waiting):
                    if not self._gather_new_batch():
                        continue
                else:
                    self._take_queued(block_until=None)
                self._admit_waiting()
                self._drop_cancelled()
                if len(self.batch):
                    self._step()
                if self.decodes is not None:
                    self.decodes.run()  # what the jobs asked for in this iteration, together
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

    def _gather_new_batch(self) -> bool:
        # cleared before looking, so whatever arrives after the look sets it again and the wait
        # ends at once; with work already here, no wait (a batch that emptied in one iteration,
        # say segments of a step or two, left the rest of its request queued)
        self._wakeup.clear()
        if self._queue.empty() and self._calls.empty() and not self._stop.is_set():
            self._wakeup.wait(0.5)
        if self.batch is None or self._queue.empty():
            return False
        first = self._queue.get_nowait()
        self._start_job(first)
        self._take_queued(block_until=time.monotonic() + self.policy.batch_wait_seconds)
        return True

    def _take_queued(self, block_until: float | None) -> None:
        while len(self.batch) + len(self._waiting) < self.policy.max_batch:
            try:
                remaining = 0.0 if block_until is None else block_until - time.monotonic()
                if remaining <= 0:  # what is queued already joins, however short the wait
                    job = self._queue.get_nowait()
                else:
                    job = self._queue.get(timeout=remaining)
            except queue.Empty:
                return
            self._start_job(job)

    def _start_job(self, job: Job) -> None:
        if job.future.cancelled() or not job.future.set_running_or_notify_cancel():
            return
        if job.future.stop_requested:
            job.future.set_exception(JobCancelled("cancelled before it started"))
            return
        try:
            sequence = job.start()
        except Exception as error:
            job.future.set_exception(error)
            return
        self._owners[sequence] = job
        self._waiting.append((job, sequence))

    def _admit_waiting(self) -> None:
        """Prefill waiting sequences in arrival order while rows and the KV budget allow.

        Strictly first come, first served: a long request that does not fit yet is not
        overtaken by shorter ones behind it, so it cannot starve."""
        pending, self._waiting = self._waiting, []
        while pending:
            job, sequence = pending[0]
            if job.future.stop_requested:
                pending.pop(0)
                self._advance(sequence)
                continue
            fits = (
                self.batch.free_rows > 0
                and len(self.batch) < self.policy.max_batch
                and (
                    not len(self.batch)
                    or self.batch.reserved_positions() + sequence.kv_positions()
                    <= self.kv_budget_positions
                )
            )
            if not fits:
                break
            pending.pop(0)
            started = time.perf_counter()
            try:
                self.batch.add(sequence)
            except Exception as error:
                log.exception("prefill failed")
                del self._owners[sequence]
                job.future.set_exception(error)
                continue
            if self._on_prefill is not None:
                self._on_prefill(sequence.prompt.shape[0], time.perf_counter() - started)
            if sequence.finished:  # done at its first token: hand over to the job's next stage
                self._advance(sequence)
                pending.extend(self._waiting)
                self._waiting = []
        self._waiting = pending + self._waiting

    def _step(self) -> None:
        rows = len(self.batch)
        started = time.perf_counter()
        try:
            finished = self.batch.step()
        except Exception as error:
            log.exception("decode step failed")
            self._fail_all(error)
            return
        if self._on_step is not None:
            self._on_step(rows, time.perf_counter() - started)
        for sequence in finished:
            self._advance(sequence)
        not_yet = []
        for sequence in self.batch.active:
            if not self._progress(sequence, joining=False):
                not_yet.append(sequence)
        if self.decodes is not None and len(self.decodes):  # e.g. streams' chunks worth joining
            for sequence in not_yet:
                self._progress(sequence, joining=True)

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
        """Sequences whose caller gave up (deadline passed, client left) stop costing steps."""
        leaving = [
            sequence
            for sequence in self.batch.active
            if self._owners[sequence].future.stop_requested
        ]
        for sequence in self.batch.remove(leaving):
            self._advance(sequence)

    def _advance(self, sequence: Sequence) -> None:
        job = self._owners.pop(sequence)
        if job.future.stop_requested:
            if not job.future.done():
                job.future.set_exception(JobCancelled("cancelled while generating"))
            return
        try:
            following = job.advance(sequence)
        except Exception as error:
            job.future.set_exception(error)
            return
        if following is not None:
            self._owners[following] = job
            self._waiting.append((job, following))

    def _fail_all(self, error: Exception) -> None:
        for sequence in self.batch.remove(list(self.batch.active)):
            job = self._owners.pop(sequence)
            if not job.future.done():
                job.future.set_exception(error)
