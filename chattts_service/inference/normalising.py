"""wetext's normalisation in a process of its own.

wetext searches its grammars in C++ that keeps the interpreter's lock for the whole search
(~2.5 ms a sentence), so a request thread normalising a long text in the service's process
takes the lock from the scheduler's thread between every two of its tensor operations:
measured, two threads normalising made a thread's small matrix products 9x slower (Zen 4, two
cores), and a stream's first audio waited ~0.25 s behind two long texts arriving with it. In a
process of its own the search costs a core's time and nothing else.

One worker process (spawned: the service's process has torch's threads running), its grammars
loaded by ``warm_up``; calls from any thread, each waiting without the lock. A worker that
dies (killed, out of memory) is replaced at the next call, which is tried again once; where
no worker can be started the texts are normalised here, as before, and the log says so.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from chattts_service.domain.text import NORMALISER

log = logging.getLogger(__name__)
T = TypeVar("T")

HERE_AT_MOST = 4  # sentences normalised on the caller's thread (~2.5 ms each)
BATCH = 8  # sentences per call to the worker: one caller's long text never holds it long
WORKER_NICENESS = 5  # the worker yields the cores to the model's threads


class NormaliserProcess:
    """``domain.text.Normaliser``'s calls, run by a worker process."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # one pool at a time, (re)started by one thread
        self._in_process = False  # no worker could be started: normalise here
        self.restarts = 0

    def __call__(self, text: str, language: str | None = None) -> str:
        return self.many([text], language)[0]

    def many(self, items: list[str], language: str | None = None) -> list[str]:
        """Each text normalised (``Normaliser.__call__``): a few here (a few milliseconds,
        sooner than the worker would get a core), more by the worker, ``BATCH`` at a time."""
        if len(items) <= HERE_AT_MOST:
            return _normalise_many(items, language)
        out: list[str] = []
        for start in range(0, len(items), BATCH):
            out += self._run(_normalise_many, items[start : start + BATCH], language)
        return out

    def warm_up(self) -> None:
        """Load the grammars here (short texts) and in the worker, started for it, at once."""
        self._run(_warm_up, meanwhile=_warm_up)

    def _run(
        self, function: Callable[..., T], *args: Any, meanwhile: Callable[[], object] | None = None
    ) -> T:
        """``function(*args)`` by the worker, ``meanwhile()`` here while it works; here instead
        where no worker can be started, or when a worker and its replacement both died."""
        for attempt in range(2):
            pool = self._running_pool()
            if pool is None:
                break
            try:
                future = pool.submit(function, *args)
                if meanwhile is not None:
                    meanwhile()
                return future.result()
            except BrokenProcessPool:
                self._replace(pool, attempt)
            except OSError as error:  # no worker could be started
                self._give_up(error)
        return function(*args)

    def worker_pid(self) -> int | None:
        """The worker's process id, asked of it (None before a worker was started, when
        normalising here, or when the worker has died)."""
        pool = self._pool
        if pool is None:
            return None
        try:
            return pool.submit(os.getpid).result()
        except BrokenProcessPool:
            return None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _running_pool(self) -> ProcessPoolExecutor | None:
        """The worker's pool, made if there is none; None once normalising here."""
        with self._lock:
            if self._pool is None and not self._in_process:
                try:
                    self._pool = ProcessPoolExecutor(
                        max_workers=1,
                        mp_context=multiprocessing.get_context("spawn"),
                        initializer=_worker_started,
                        initargs=(WORKER_NICENESS,),
                    )
                except OSError as error:
                    self._normalise_here(error)
            return self._pool

    def _give_up(self, error: OSError) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._normalise_here(error)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _normalise_here(self, error: OSError) -> None:
        """From now on, in this process (under ``_lock``)."""
        log.warning("no normalising process (%s): normalising in this one", error)
        self._in_process = True

    def _replace(self, broken: ProcessPoolExecutor, attempt: int) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = None
                self.restarts += 1
        broken.shutdown(wait=False, cancel_futures=True)
        log.warning("the normalising process died; starting another (try %d)", attempt + 2)


# -- in the worker -------------------------------------------------------------------------------


def _normalise_many(items: list[str], language: str | None) -> list[str]:
    return NORMALISER.many(items, language)


def _warm_up() -> None:
    NORMALISER.warm_up()


def _worker_started(niceness: int) -> None:
    """Yield the cores (``niceness``), and leave when the service's process has gone (killed:
    nothing told the worker, which would wait for calls for ever)."""
    os.nice(niceness)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
