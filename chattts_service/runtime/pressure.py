"""Degraded mode: cheaper settings while the CPU stays saturated, normal ones when it eases.

A background thread samples the process's CPU use once a second. When it has stayed at or above
``CHATTTS_DEGRADE_CPU_PERCENT`` for ``CHATTTS_DEGRADE_AFTER_S`` seconds the service degrades:
requests skip text refinement and each segment's step cap drops to
``CHATTTS_DEGRADED_MAX_NEW_TOKENS``. It returns to normal once the CPU has stayed below the
threshold for as long. Degraded answers carry ``X-Degraded: 1``; they are cached under the key of
what was actually made (no refinement) unless the lowered cap cut a segment short;
``chatts_degraded`` shows the state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from chattts_service.runtime.cpu import CpuSampler, process_cpu_seconds

log = logging.getLogger(__name__)


class Pressure:
    def __init__(
        self,
        threshold_percent: float,
        hold_seconds: float,
        on_change: Callable[[bool], None] | None = None,
        cpu_seconds: Callable[[], float] = process_cpu_seconds,
        interval: float = 1.0,
    ):
        self.threshold = threshold_percent
        self.hold = hold_seconds
        self.degraded = False
        self.last_percent = 0.0
        self._on_change = on_change
        self._cpu_seconds = cpu_seconds
        self._interval = interval
        self._since: float | None = None  # when the reading last crossed to the other side
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.threshold <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="cpu-pressure", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        sampler = CpuSampler(self._cpu_seconds, min_interval=0.0)
        while not self._stop.wait(self._interval):
            self.observe(sampler.percent(), time.monotonic())

    def observe(self, percent: float, now: float) -> None:
        """One reading; switches mode once readings stay on the other side for ``hold``."""
        self.last_percent = percent
        pressing = percent >= self.threshold
        if pressing == self.degraded:
            self._since = None
            return
        if self._since is None:
            self._since = now
        if now - self._since >= self.hold:
            self.degraded = pressing
            self._since = None
            log.warning(
                "CPU %s %.0f%% for %.0f s: %s",
                "above" if pressing else "below",
                self.threshold,
                self.hold,
                "degraded mode on (no refinement, shorter step cap)"
                if pressing
                else "back to normal settings",
            )
            if self._on_change is not None:
                self._on_change(pressing)
