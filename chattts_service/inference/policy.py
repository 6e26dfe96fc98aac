"""The batching policy: one object owns the knobs that shape batching and admission.

How many requests generate together (``max_batch``), how long an idle scheduler waits for more
(``batch_wait_ms``), how many may queue (``max_queue``), how long an estimated wait may be
before a request is refused at once (``max_wait_s``), the rows bulk work keeps whatever waits
(``bulk_min_rows``, see ``fairness``) and how long a prefill may hold the running rows between
two steps (``stall_budget_ms``). The scheduler and the admission check
read it at every decision; ``/admin/config`` reads and tunes it through ``snapshot`` and
``tune``. Bounds come from the settings' declarations, except ``max_batch``, which can only go
down from its configured value (the heads are built for that many rows).
"""

from __future__ import annotations

import threading

from chattts_service.config import Bounds, Settings

KNOBS = (
    "max_batch",
    "batch_wait_ms",
    "max_queue",
    "max_wait_s",
    "bulk_min_rows",
    "bulk_rows_while_starting",
    "stall_budget_ms",
)


class PolicyError(ValueError):
    """A tuning request names an unknown knob or a value out of its bounds."""


def _bounds(name: str) -> Bounds:
    """A knob's declared range (every knob is an integer setting with one)."""
    bounds = Settings.bounds(name)
    if bounds is None:
        raise ValueError(f"{name} declares no bounds")
    return bounds


class BatchingPolicy:
    def __init__(
        self,
        max_batch: int,
        batch_wait_ms: int,
        max_queue: int,
        max_wait_s: int,
        limits: dict[str, Bounds],
        bulk_min_rows: int,
        stall_budget_ms: int,
        bulk_rows_while_starting: int,
    ):
        self._lock = threading.Lock()
        self._limits = dict(limits)
        self._values = {
            "max_batch": max_batch,
            "batch_wait_ms": batch_wait_ms,
            "max_queue": max_queue,
            "max_wait_s": max_wait_s,
            "bulk_min_rows": bulk_min_rows,
            "bulk_rows_while_starting": bulk_rows_while_starting,
            "stall_budget_ms": stall_budget_ms,
        }

    @classmethod
    def from_settings(cls, settings: Settings) -> BatchingPolicy:
        limits = {name: _bounds(name) for name in KNOBS}
        limits["max_batch"] = Bounds(1, settings.max_batch)
        return cls(
            settings.max_batch,
            settings.batch_wait_ms,
            settings.max_queue,
            settings.max_wait_s,
            limits,
            settings.bulk_min_rows,
            settings.stall_budget_ms,
            settings.bulk_rows_while_starting,
        )

    @property
    def max_batch(self) -> int:
        return self._values["max_batch"]

    @property
    def batch_wait_seconds(self) -> float:
        return self._values["batch_wait_ms"] / 1000.0

    @property
    def max_queue(self) -> int:
        return self._values["max_queue"]

    @property
    def max_wait_s(self) -> int:
        return self._values["max_wait_s"]

    @property
    def bulk_min_rows(self) -> int:
        return self._values["bulk_min_rows"]

    @property
    def bulk_rows_while_starting(self) -> int:
        return self._values["bulk_rows_while_starting"]

    @property
    def stall_budget_ms(self) -> int:
        return self._values["stall_budget_ms"]

    def limits(self) -> dict[str, Bounds]:
        return dict(self._limits)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def tune(self, **changes: int) -> dict[str, int]:
        """Change some knobs at once (all or none); returns the values now in effect."""
        for name, value in changes.items():
            if name not in self._limits:
                raise PolicyError(f"unknown knob {name!r}; knobs: {', '.join(KNOBS)}")
            bounds = self._limits[name]
            if isinstance(value, bool) or not isinstance(value, int) or value not in bounds:
                raise PolicyError(f"'{name}' must be an integer {bounds.describe()}")
        with self._lock:
            self._values.update(changes)
            return dict(self._values)
