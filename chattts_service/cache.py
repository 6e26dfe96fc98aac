"""The LRU cache of encoded audio in front of inference.

The key is a digest of every input that changes the audio, plus the identity of the model that
made it, so two requests that would sound different can never share an entry.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict

from lru import LRU

from .engine import SynthesisRequest


def cache_key(request: SynthesisRequest, model_identity: str) -> str:
    payload = json.dumps({"model": model_identity, **asdict(request)},
                         sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class AudioCache:
    """A thread-safe LRU of ``key -> (wav bytes, audio seconds)``; size 0 disables it."""

    def __init__(self, size: int):
        self.size = size
        self._entries = LRU(size) if size > 0 else None
        self._lock = threading.Lock()

    def get(self, key: str):
        if self._entries is None:
            return None
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, value) -> None:
        if self._entries is None:
            return
        with self._lock:
            self._entries[key] = value

    def __len__(self) -> int:
        if self._entries is None:
            return 0
        with self._lock:
            return len(self._entries)
