"""Engines with their own settings on a test model, loaded and closed around a block; and
streams read at once, as concurrent listeners read them."""

from __future__ import annotations

import threading
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


def read_streams(runs, timeout: float = 120) -> list[list]:
    """Each streamed ``Run``'s chunks, every run read on a thread of its own at the same time
    (so their chunks are decoded together, as concurrent listeners' are)."""
    results: list = [None] * len(runs)

    def read(index: int) -> None:
        results[index] = list(runs[index].chunks(timeout=timeout))

    threads = [threading.Thread(target=read, args=(index,)) for index in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
