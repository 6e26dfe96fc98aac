"""Files kept beside the model: named by what they were made from, written whole or not at all."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def replace_atomically(
    path: Path, write: Callable[[IO[Any]], object], binary: bool = True, shared: bool = True
) -> None:
    """Write ``path`` through ``write(out)`` into a temporary file beside it, renamed over it
    when whole: a killed process never leaves half a file under the real name. ``shared``
    makes it readable by every user (replicas may run as other users). Raises OSError."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        opened = os.fdopen(handle, "wb") if binary else os.fdopen(handle, "w", encoding="utf-8")
        with opened as out:
            write(out)
        if shared:
            os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def listing(directory: Path) -> list[list]:
    """The files in ``directory`` as they are now: name, size and modification time of each."""
    files = []
    for path in sorted(Path(directory).iterdir()):
        if path.is_file():
            stat = path.stat()
            files.append([path.name, stat.st_size, stat.st_mtime_ns])
    return files


def identity_key(identity: dict) -> str:
    """A short name for ``identity`` (what a kept file was made from), for its file name."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
