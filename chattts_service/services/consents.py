"""Voice consents: the recordings in which a speaker agrees to a voice being made from them.

OpenAI's VoiceConsent objects (``{id, object: "audio.voice_consent", name, language,
created_at}``), kept beside the voices so an operator can audit who consented: for each, a
record ``consents/<id>.json`` and the recording as it was uploaded, ``consents/<id>.<ext>``
(with its size and sha256 in the record). Every file is written atomically, the recording
before its record, so a consent is either wholly there or not at all; replicas sharing the
volume see the same consents.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from chattts_service.runtime.files import replace_atomically

CONSENT_ID = re.compile(r"^cons_[0-9a-f]{24}$")
LANGUAGE = re.compile(r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8}){0,3}$")  # BCP 47, as OpenAI takes it
MAX_LABEL_CHARS = 256
MAX_PAGE = 100  # OpenAI's: a page holds 1 to 100 objects, 20 unless asked
DEFAULT_PAGE = 20


class ConsentError(ValueError):
    """A consent request that cannot be met; the message says why."""


class UnknownConsent(ConsentError):
    pass


class TooManyConsents(ConsentError):
    pass


def check_label(name: object) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ConsentError("'name' must be a non-empty string")
    if len(name) > MAX_LABEL_CHARS:
        raise ConsentError(f"'name' is longer than {MAX_LABEL_CHARS} characters")
    return name.strip()


class ConsentStore:
    """``limit``: how many consents may be kept at once."""

    def __init__(self, directory: Path, limit: int):
        self.directory = Path(directory)
        self.limit = limit
        self._lock = threading.Lock()

    def create(
        self, name: object, language: object, recording: bytes, extension: str
    ) -> dict[str, Any]:
        name = check_label(name)
        if not isinstance(language, str) or not LANGUAGE.match(language):
            raise ConsentError("'language' must be a BCP 47 tag such as en-US or zh-CN")
        with self._lock:
            if self.count() >= self.limit:
                raise TooManyConsents(
                    f"{self.limit} consents are kept, the most this server keeps "
                    "(CHATTTS_MAX_STORED_VOICES); delete one first"
                )
            self.directory.mkdir(parents=True, exist_ok=True)
            consent_id = f"cons_{secrets.token_hex(12)}"
            audio_name = f"{consent_id}.{extension}"
            replace_atomically(
                self.directory / audio_name, lambda out: out.write(recording), shared=False
            )
            record = {
                "id": consent_id,
                "object": "audio.voice_consent",
                "name": name,
                "language": language,
                "created_at": int(time.time()),
                "recording": {
                    "file": audio_name,
                    "bytes": len(recording),
                    "sha256": hashlib.sha256(recording).hexdigest(),
                },
            }
            self._write(record)
        return public(record)

    def get(self, consent_id: object) -> dict[str, Any]:
        return public(self._record(consent_id))

    def exists(self, consent_id: object) -> bool:
        try:
            self._record(consent_id)
        except UnknownConsent:
            return False
        return True

    def rename(self, consent_id: object, name: object) -> dict[str, Any]:
        name = check_label(name)
        with self._lock:
            record = self._record(consent_id)
            record["name"] = name
            self._write(record)
        return public(record)

    def delete(self, consent_id: object) -> dict[str, Any]:
        with self._lock:
            record = self._record(consent_id)
            (self.directory / f"{record['id']}.json").unlink()  # the record first: then gone
            (self.directory / record["recording"]["file"]).unlink(missing_ok=True)
        return {"id": record["id"], "object": "audio.voice_consent", "deleted": True}

    def page(self, after: str | None, limit: int) -> dict[str, Any]:
        """Newest first; ``after`` an id from the previous page (OpenAI's cursor paging)."""
        records = sorted(self._records(), key=lambda r: (r["created_at"], r["id"]), reverse=True)
        start = 0
        if after is not None:
            ids = [record["id"] for record in records]
            if after not in ids:
                raise UnknownConsent(f"no consent {after!r} to list after")
            start = ids.index(after) + 1
        data = [public(record) for record in records[start : start + limit]]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(records),
        }

    def count(self) -> int:
        if not self.directory.is_dir():
            return 0
        return sum(1 for path in self.directory.glob("cons_*.json") if CONSENT_ID.match(path.stem))

    def _records(self) -> list[dict[str, Any]]:
        if not self.directory.is_dir():
            return []
        records = []
        for path in self.directory.glob("cons_*.json"):
            if CONSENT_ID.match(path.stem):
                try:
                    records.append(json.loads(path.read_text(encoding="utf-8")))
                except (OSError, ValueError):
                    continue  # deleted while listing, or not ours
        return records

    def _record(self, consent_id: object) -> dict[str, Any]:
        if not isinstance(consent_id, str) or not CONSENT_ID.match(consent_id):
            raise UnknownConsent(
                f"no consent {consent_id!r}; ids look like cons_ and 24 hex digits"
            )
        try:
            record: dict[str, Any] = json.loads(
                (self.directory / f"{consent_id}.json").read_text(encoding="utf-8")
            )
            return record
        except FileNotFoundError:
            raise UnknownConsent(f"no consent {consent_id!r}") from None

    def _write(self, record: dict[str, Any]) -> None:
        replace_atomically(
            self.directory / f"{record['id']}.json",
            lambda out: json.dump(record, out, ensure_ascii=False),
            binary=False,
            shared=False,
        )


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The VoiceConsent object a client sees (the recording's file stays the operator's)."""
    return {key: record[key] for key in ("id", "object", "name", "language", "created_at")}
