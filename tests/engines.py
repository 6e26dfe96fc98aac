"""Engines with their own settings on a test model, loaded and closed around a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from chattts_service.config import Settings
from chattts_service.inference.engine import Engine


@contextmanager
def engine_on(model_dir: Path, **settings) -> Iterator[Engine]:
    """``Engine`` on ``model_dir`` (not verified; one torch thread unless ``threads`` says
    otherwise) with ``settings`` as the service's fields, loaded; closed when the block ends,
    the load failing included."""
    engine = Engine(
        Settings.from_env({}, model_dir=model_dir, verify_model=False, **{"threads": 1, **settings})
    )
    try:
        engine.load()
        yield engine
    finally:
        engine.close()
