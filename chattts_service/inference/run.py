"""The segments of one request, generating in the scheduler: waited on whole, or streamed.

A request thread holds a ``Run``. It polls its jobs' futures a few times a second so that a
deadline or a client that left is noticed while the model works; either cancels every segment
still queued or generating.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from chattts_service.domain.speech import (
    SAMPLE_RATE,
    Cancelled,
    DeadlineExceeded,
    EngineError,
    Synthesis,
)
from chattts_service.inference.job import SynthesisJob
from chattts_service.inference.scheduler import JobCancelled

STOP_POLL_SECONDS = 0.25  # how often a waiting request checks its client


class Run:
    """``sentences``: each sentence of the text as written, with how many of the jobs (in
    order) speak it; 0 for a sentence with nothing to say."""

    def __init__(
        self,
        jobs: list[SynthesisJob],
        pause_seconds: float,
        sentences: list[tuple[str, int]] | None = None,
    ):
        self.jobs = jobs
        self.pause = np.zeros(round(pause_seconds * SAMPLE_RATE), dtype=np.float32)
        self.sentences = sentences or []

    def cancel(self) -> None:
        for job in self.jobs:
            job.future.cancel()

    def result(
        self, timeout: float | None = None, should_stop: Callable[[], bool] | None = None
    ) -> Synthesis:
        """Wait for every segment and join them with a short pause."""
        deadline = _deadline(timeout)
        try:
            parts = [self._wait(job, deadline, timeout, should_stop) for job in self.jobs]
        except BaseException:
            self.cancel()
            raise
        pieces = []
        for index, part in enumerate(parts):
            if index:
                pieces.append(self.pause)
            pieces.append(part.audio)
        return Synthesis(
            audio=np.concatenate(pieces),
            sample_rate=SAMPLE_RATE,
            steps=sum(part.steps for part in parts),
            spoken_text=" ".join(part.spoken_text for part in parts),
            segments=len(parts),
            truncated=self.truncated,
            provisional=self.provisional,
            part_samples=tuple(len(part.audio) for part in parts),
            part_texts=tuple(part.spoken_text for part in parts),
            pause_samples=len(self.pause),
        )

    @property
    def truncated(self) -> int:
        """Segments stopped by their step cap; read once every segment has finished."""
        return sum(job.future.result().truncated for job in self.jobs)

    @property
    def provisional(self) -> int:
        """Steps streamed with a look-ahead shorter than the decoder's context (so not the
        whole answer's samples); read once every segment has finished."""
        return sum(job.future.result().provisional for job in self.jobs)

    def chunks(
        self, timeout: float | None = None, should_stop: Callable[[], bool] | None = None
    ) -> Iterator[np.ndarray]:
        """Audio as it is decoded, segment after segment (the same samples ``result`` joins).
        Closing the iterator early cancels what is still generating."""
        deadline = _deadline(timeout)
        try:
            for index, job in enumerate(self.jobs):
                if index:
                    yield self.pause
                chunks = job.chunks
                if chunks is None:
                    raise ValueError("chunks: the run was not started as a stream")
                while True:
                    try:
                        chunk = chunks.get(timeout=_poll(deadline))
                    except queue.Empty:
                        # a finished job's chunks, end marker included, are already queued
                        self._check(job, deadline, timeout, should_stop)
                        continue
                    if chunk is None:
                        break
                    yield chunk
        finally:
            if not all(job.future.done() for job in self.jobs):
                self.cancel()

    def _wait(self, job, deadline, timeout, should_stop) -> Synthesis:
        while True:
            try:
                return _future_result(job.future, _poll(deadline))
            except FutureTimeout:
                self._check(job, deadline, timeout, should_stop)

    @staticmethod
    def _check(job, deadline, timeout, should_stop) -> None:
        """Raise if the job failed, its deadline passed or its client left."""
        if job.future.done():
            _future_result(job.future, 0)  # raises its failure
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded(f"not finished within {timeout:g} s")
        if should_stop is not None and should_stop():
            raise Cancelled("the client went away")


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _poll(deadline: float | None) -> float:
    if deadline is None:
        return STOP_POLL_SECONDS
    return min(STOP_POLL_SECONDS, max(0.0, deadline - time.monotonic()))


def _future_result(future, wait):
    try:
        return future.result(wait)
    except FutureTimeout:
        raise
    except (JobCancelled, CancelledError) as error:
        raise Cancelled(str(error) or "cancelled") from None
    except EngineError:
        raise
    except Exception as error:  # a failure inside the model thread, logged there
        raise EngineError(f"{error.__class__.__name__}: {error}") from error
