"""The CPU: what it is and can do (model, feature flags, the CPUs this process may use), and
the process's use of it, one sampler for the metrics scrape and for degraded mode.

Nothing here imports torch; the settings and the kernels ask it.
"""

from __future__ import annotations

import functools
import os
import platform
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
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read): x86's
    ``flags``, or on aarch64 its ``Features`` (asimddp, i8mm, bf16...; never x86's, which an
    arm64 process under qemu-user would otherwise read off its x86 host). Read once: the
    questions asked of it come on every request (cache key) and every decode."""
    field = "Features" if platform.machine() == "aarch64" else "flags"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            line = next((line for line in handle if line.startswith(field)), "")
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


def host_cpu_ticks(path: str = "/proc/stat") -> tuple[int, int] | None:
    """This machine's CPU time so far, summed over its CPUs, in clock ticks: (all of it, the
    part a hypervisor ran something else on, "steal"), from the aggregate ``cpu`` line of
    ``path``; None where it cannot be read (not Linux, or a kernel without the steal field).
    Guest time is already counted in user time, so it is left out of the total."""
    try:
        with open(path, encoding="ascii") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    try:
        ticks = [int(value) for value in fields[1:9]]  # user .. steal
    except ValueError:
        return None
    return sum(ticks), ticks[7]


class StealMeter:
    """The share of this machine's CPU time a hypervisor took between ``start`` (or the
    meter's creation) and ``share``: on a shared virtual machine, a figure measured while it
    was high is slowed by something the code did not do."""

    def __init__(self, path: str = "/proc/stat"):
        self.path = path
        self.start()

    def start(self) -> None:
        self._start = host_cpu_ticks(self.path)

    def share(self) -> float | None:
        """Stolen ticks over all ticks since the start; None where they cannot be read or
        none passed (an idle CPU's ticks are counted late, so a run of a few milliseconds may
        see none)."""
        now = host_cpu_ticks(self.path)
        if now is None or self._start is None or now[0] <= self._start[0]:
            return None
        return (now[1] - self._start[1]) / (now[0] - self._start[0])


STEAL_WARNING = 0.05  # above this share, absolute figures are visibly slowed


def describe_steal(share: float | None) -> str:
    """A line for a benchmark's report: how much of the CPU time the hypervisor took."""
    if share is None:
        return "steal: not measured (unreadable here, or too short a run)"
    text = f"steal: the hypervisor took {100 * share:.1f}% of this machine's CPU time"
    if share > STEAL_WARNING:
        text += " (absolute figures are slowed by it; compare figures measured side by side)"
    return text
