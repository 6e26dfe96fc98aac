"""Tuning the running service: the batching and sharing knobs, their bounds, and the
scheduler's order, as ``/admin/config`` shows and changes them. Who may call it (API keys) is
the API's concern; what may be changed, and within which bounds, is the policy's."""

from __future__ import annotations

import logging
from collections.abc import Callable

from chattts_service.config import Bounds
from chattts_service.inference.engine import Engine
from chattts_service.inference.fairness import ORDER
from chattts_service.inference.policy import PolicyError
from chattts_service.services.voices import NotLoaded

log = logging.getLogger(__name__)


class TuningRejected(ValueError):
    """A change names an unknown knob or a value out of its bounds; the message says which."""


class AdminService:
    """``phase()``: the service's phase, named when the model is not loaded yet."""

    def __init__(self, engine: Engine, phase: Callable[[], str]):
        self._engine = engine
        self._phase = phase

    def _check_loaded(self) -> None:
        if not self._engine.loaded:
            raise NotLoaded(f"model is not ready ({self._phase()})")

    def limits(self) -> dict[str, Bounds]:
        """Each knob's bounds (known before the model loads)."""
        return self._engine.policy.limits()

    def current(self) -> dict[str, int]:
        self._check_loaded()
        return self._engine.policy.snapshot()

    @staticmethod
    def order() -> list[str]:
        """The scheduler's rules, in the words ``/admin/config`` shows."""
        return list(ORDER)

    def tune(self, changes: dict[str, int]) -> dict[str, int]:
        """Apply ``changes`` between two steps; the settings now in effect."""
        self._check_loaded()
        try:
            current = self._engine.tune(**changes)
        except PolicyError as error:
            raise TuningRejected(str(error)) from None
        log.warning("batching tuned at run time: %s", changes)
        return current
