"""Voices and the consents they are made under: what the voice routes ask of the service.

A voice from a recording is made here, not in a handler: the consent is checked, the store's
room too (before the work, and again under the store's lock when writing), the recording
decoded to 24 kHz mono, encoded to ChatTTS's speaker prompt by the engine, and stored. Every
refusal is a domain error (``VoiceError``, ``ConsentError``, ``RecordingError``,
``EngineError``, ``NotLoaded``) that the API maps to a status in one table.

There is one voice store (the engine's, made when the model loads) and one consent store per
process, each with the lock that makes its bound (``CHATTTS_MAX_STORED_VOICES``) hold across
concurrent requests.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

from chattts_service.config import Settings
from chattts_service.domain.voice_store import VoiceStore
from chattts_service.domain.voices import DEFAULT_VOICES, SpeakerSample, Voice, VoiceError
from chattts_service.inference.engine import Engine
from chattts_service.services import recordings
from chattts_service.services.consents import ConsentStore, UnknownConsent
from chattts_service.services.recordings import (
    MAX_CONSENT_SECONDS,
    MAX_SAMPLE_SECONDS,
    MIN_CONSENT_SECONDS,
    MIN_SAMPLE_SECONDS,
)


class NotLoaded(Exception):
    """The model (and what it brings: the voice store, the policy) is not loaded yet; the
    message names the phase."""


class TranscriptError(VoiceError):
    """A voice sample's transcript that cannot be a prompt."""


class VoiceService:
    """``phase()``: the service's phase, named when the model is not loaded yet."""

    def __init__(self, settings: Settings, engine: Engine, phase: Callable[[], str]):
        self._engine = engine
        self._phase = phase
        self.consents = ConsentStore(settings.voices_dir / "consents", settings.max_stored_voices)

    def _store(self) -> VoiceStore:
        store = self._engine.voices
        if store is None:
            raise NotLoaded(f"model is not ready ({self._phase()})")
        return store

    # -- reading -------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The names a request may use now: the defaults until the model (and its store)
        loads."""
        store = self._engine.voices
        return store.names() if store is not None else list(DEFAULT_VOICES)

    def listing(self) -> list[dict[str, Any]]:
        return self._store().listing()

    def get(self, name: str) -> Voice:
        return self._store().get(name)

    def resolve(self, name: str, field: str) -> Voice:
        """The voice a request's ``field`` names (a name, an id, ``seed:N``, a blend); an
        error names the field."""
        return self._store().resolve(name, field)

    # -- changing ------------------------------------------------------------------------------

    def register(self, name: str, embedding: str | None, replace: bool, voice: str | None) -> Voice:
        """A named voice from a ChatTTS speaker embedding string, or a copy of a voice this
        server resolves (a blend such as ``alloy(2)+echo(1)``, ``seed:N``)."""
        return self._store().register(name, embedding, replace=replace, voice=voice)

    def from_recording(self, name: str, recording: bytes, consent: str, transcript: str) -> Voice:
        """OpenAI's ``voices.create(audio_sample=..., consent=..., name=...)``: the recording
        -> 24 kHz mono -> the DVAE's codes (``Chat.sample_audio_speaker``) -> a stored voice
        (the store checks its room again as it writes)."""
        store = self._store()
        if not self.consents.exists(consent):
            raise UnknownConsent(
                f"no consent {consent!r}: record one with POST /v1/audio/voice_consents"
            )
        words = spoken_words(transcript)
        store.check_room()  # before the work, and again when storing
        samples = recordings.read(recording, "audio_sample", MAX_SAMPLE_SECONDS, MIN_SAMPLE_SECONDS)
        codes = self._engine.encode_sample(samples)
        prompt = self._engine.sample_prompt(codes)
        return store.create_from_sample(name, SpeakerSample(codes, words), prompt, consent)

    def delete(self, name: str) -> Voice:
        return self._store().delete(name)

    # -- consents ------------------------------------------------------------------------------

    def record_consent(
        self, name: str, language: str, recording: bytes, extension: str
    ) -> dict[str, Any]:
        """A speaker's consent, its recording kept for audit once it reads as speech of a
        consent's length."""
        recordings.read(recording, "recording", MAX_CONSENT_SECONDS, MIN_CONSENT_SECONDS)
        return self.consents.create(name, language, recording, extension)


def spoken_words(value: str) -> str:
    """The words spoken in a sample, as upstream takes ``txt_smp``: as written (ChatTTS's
    issue #648: the prompt must say what the recording says), control characters removed."""
    text = unicodedata.normalize("NFC", value)
    text = "".join(ch for ch in text if ch.isprintable() or ch == " ").strip()
    if "[" in text or "]" in text:
        raise TranscriptError("'transcript' is the words spoken in the sample: no [control] tokens")
    return text
