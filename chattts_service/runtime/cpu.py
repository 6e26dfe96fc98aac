"""The process's CPU use, as a percentage of the CPUs it may run on: one sampler for the
metrics scrape and for degraded mode."""

from __future__ import annotations

import os
import threading
import time

from chattts_service.config import available_cpus


def process_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


class CpuSampler:
    """CPU use since the previous reading; readings closer than ``min_interval`` apart repeat
    the last value (shorter intervals are too noisy to mean anything)."""

    def __init__(self, cpu_seconds=process_cpu_seconds, min_interval: float = 0.5):
        self._cpu_seconds = cpu_seconds
        self._min_interval = min_interval
        self._lock = threading.Lock()
        self._last_wall = time.monotonic()
        self._last_cpu = cpu_seconds()
        self._last_percent = 0.0

    def percent(self) -> float:
        with self._lock:
            wall, cpu = time.monotonic(), self._cpu_seconds()
            elapsed = wall - self._last_wall
            if elapsed >= self._min_interval:
                used = (cpu - self._last_cpu) / elapsed / available_cpus() * 100.0
                self._last_percent = max(0.0, min(100.0, used))
                self._last_wall, self._last_cpu = wall, cpu
            return self._last_percent
