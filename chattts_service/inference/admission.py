"""Admission: take a request's segments only when the queue has room and the wait is bearable.

The wait estimate is the jobs ahead plus the new ones, run ``max_batch`` at a time, each taking
the recent average time of a job (an exponential moving average fed by finished jobs).
"""

from __future__ import annotations

import threading

from chattts_service.domain.speech import Overloaded
from chattts_service.inference.policy import BatchingPolicy
from chattts_service.inference.scheduler import Scheduler

DEFAULT_RETRY_AFTER_S = 5.0


class Admission:
    def __init__(self, policy: BatchingPolicy):
        self.policy = policy
        self._lock = threading.Lock()
        self._job_seconds: float | None = None  # recent average time of one job

    def job_finished(self, seconds: float) -> None:
        """Scheduler thread: a job's time from start to audio."""
        with self._lock:
            previous = self._job_seconds
            self._job_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def assume_job_seconds(self, seconds: float) -> None:
        """Seed the estimate (a load test or a test that needs a known figure)."""
        with self._lock:
            self._job_seconds = seconds

    def estimated_wait(self, scheduler: Scheduler, segments: int = 1) -> float | None:
        """Seconds until ``segments`` new jobs would be done; None before any job ran."""
        if self._job_seconds is None:
            return None
        ahead = scheduler.depth + segments
        return -(-ahead // self.policy.max_batch) * self._job_seconds

    def check(self, scheduler: Scheduler, segments: int) -> None:
        """Raise Overloaded when the queue cannot take ``segments`` jobs or the estimated wait
        is longer than the policy's ``max_wait_s`` (0: no limit)."""
        wait = self.estimated_wait(scheduler, segments)
        if scheduler.free_queue_slots() < segments:
            raise Overloaded(
                f"the queue has no room for {segments} segment(s)",
                retry_after=wait or DEFAULT_RETRY_AFTER_S,
            )
        limit = self.policy.max_wait_s
        if limit and wait is not None and wait > limit:
            raise Overloaded(
                f"the estimated wait ({wait:.0f} s) is longer than {limit} s",
                reason="wait",
                retry_after=wait,
            )
