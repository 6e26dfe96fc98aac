"""The CPU: what it is and can do (model, feature flags, the CPUs this process may use), and
the process's use of it, one sampler for the metrics scrape and for degraded mode.

Nothing here imports torch; the settings and the kernels ask it.
"""

from __future__ import annotations

import functools
import os
import threading
import time


def available_cpus() -> int:
    """CPUs this process may run on: honours a container's cpuset and ``numactl``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read). Read once:
    the questions asked of it come on every request (cache key) and every decode."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            line = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (model name, vendor_id, cpu family, ...);
    empty where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break  # the first processor is enough
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model numbers (figures are
    quoted with it: the same code meets a different memory system on each)."""
    fields = cpu_fields()
    if not fields:
        return "unknown CPU"
    name = fields.get("model name", "unknown CPU")
    return f"{name} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 is emulated and slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


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
