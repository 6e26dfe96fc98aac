"""The LRU cache of audio in front of inference.

The key is a digest of every input that changes the audio (text, voice embedding, seed, speed,
sampling, refinement, normalisation), the identity of the model that made it, and the output
format, so two responses that would differ can never share an entry. Each synthesis is kept as
raw PCM as well as in the format asked for: a later request for the same speech in another
format is encoded from the PCM instead of being synthesised again.

The cache is bounded both in entries and in bytes.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import fields
from typing import Any

from lru import LRU

from chattts_service.domain.speech import SynthesisRequest


def cache_key(request: SynthesisRequest, model_identity: str, audio_format: str) -> str:
    payload = {"model": model_identity, "format": audio_format, **_described(request)}
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _described(request: SynthesisRequest) -> dict[str, Any]:
    """Every field of a request as JSON values: a voice as its name and the digest of its
    embedding (a re-registered voice with the same name is a different voice), a script's
    spans likewise and its silences as their length."""
    payload: dict[str, Any] = {}
    for item in fields(request):
        value = getattr(request, item.name)
        if item.name == "voice":
            value = None if value is None else [value.name, value.digest]
        elif item.name == "parts":
            value = [
                _described(part) if isinstance(part, SynthesisRequest) else part.milliseconds
                for part in value
            ]
        payload[item.name] = value
    return payload


# a cached answer: its bytes first, then what describes them (seconds, captions...)
Entry = tuple[Any, ...]


class AudioCache:
    """A thread-safe LRU of ``key -> (bytes, audio seconds)``; size 0 disables it."""

    def __init__(self, size: int, max_bytes: int = 0):
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries = LRU(size, callback=self._evicted) if size > 0 else None
        self._lock = threading.Lock()

    def _evicted(self, key: str, value: Entry) -> None:
        self.bytes -= len(value[0])

    def get(self, key: str) -> Entry | None:
        if self._entries is None:
            return None
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, value: Entry) -> None:
        if self._entries is None or (self.max_bytes and len(value[0]) > self.max_bytes):
            return
        with self._lock:
            if key in self._entries:
                self.bytes -= len(self._entries[key][0])
            self._entries[key] = value
            self.bytes += len(value[0])
            while self.max_bytes and self.bytes > self.max_bytes and len(self._entries) > 1:
                _, evicted = self._entries.popitem(least_recent=True)
                self.bytes -= len(evicted[0])

    def __len__(self) -> int:
        if self._entries is None:
            return 0
        with self._lock:
            return len(self._entries)
