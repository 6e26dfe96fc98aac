"""Optional API keys: ``Authorization: Bearer <key>`` on everything but the probes.

Keys come from ``CHATTTS_API_KEYS`` (comma-separated) and/or ``CHATTTS_API_KEYS_FILE`` (one per
line, ``#`` comments). With no keys configured the service is open. A presented key is compared
with every configured key in constant time (digests of equal length, no early exit), and keys
never reach a log line: the access log names the path, never the headers.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from chattts_service.config import Settings, SettingsError

# Always open: orchestrator probes, the API description, the playground page and its assets.
OPEN_PATHS = ("/healthz", "/readyz", "/openapi.json", "/")
OPEN_PREFIXES = ("/static/",)


class ApiKeys:
    def __init__(self, keys: list[str]):
        self._digests = [hashlib.sha256(key.encode("utf-8")).digest() for key in keys]

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys:
        keys = [key.strip() for key in settings.api_keys.split(",") if key.strip()]
        if settings.api_keys_file:
            path = Path(settings.api_keys_file)
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except OSError as error:
                raise SettingsError(f"CHATTTS_API_KEYS_FILE {path}: {error.strerror}") from None
            keys += [
                line.strip() for line in lines if line.strip() and not line.strip().startswith("#")
            ]
        for key in keys:
            if len(key) < 16 or any(ch.isspace() for ch in key):
                raise SettingsError("API keys must be at least 16 characters, without spaces")
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def allows(self, authorization: str | None) -> bool:
        if not self._digests:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        presented = hashlib.sha256(token.strip().encode("utf-8")).digest()
        matched = False
        for digest in self._digests:  # no early exit: the time does not say which key matched
            matched |= hmac.compare_digest(presented, digest)
        return matched and scheme.lower() == "bearer"

    def name(self, authorization: str | None) -> str | None:
        """A name for the key a request presented (its digest's first 12 hex digits, never
        the key): the scheduler shares rows per key. None with no keys configured."""
        if not self._digests:
            return None
        _, _, token = (authorization or "").partition(" ")
        return hashlib.sha256(token.strip().encode("utf-8")).hexdigest()[:12]

    @staticmethod
    def is_open(path: str, protect_metrics: bool) -> bool:
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return True
        return path == "/metrics" and not protect_metrics
