"""The voice store: named voices kept as files in ``CHATTTS_VOICES_DIR`` (see ``voices`` for
what a voice is), resolved by name, ``seed:N`` or blend, with one lock for what it writes and
the bound on how many it keeps."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chattts_service.config import MAX_SEED
from chattts_service.domain.embeddings import (
    decode_embedding,
    digest,
    encode_embedding,
    sample_digest,
)
from chattts_service.domain.voices import (
    BLEND_PART,
    DEFAULT_VOICES,
    MAX_BLEND_PARTS,
    NAME,
    SEED_VOICE,
    VOICE_ID,
    SpeakerSample,
    TooManyVoices,
    UnknownVoice,
    UnusableBlend,
    Voice,
    VoiceError,
    VoiceExists,
)
from chattts_service.runtime.files import replace_atomically


class VoiceStore:
    """Resolves voice names; ``sampler(seed)`` draws a seed's voice from the loaded model."""

    def __init__(
        self,
        directory: Path,
        dim: int,
        sampler: Callable[[int], Any],
        limit: int | None = None,
        decode_sample: Callable[[str], Any] | None = None,
    ) -> None:
        """``decode_sample(text)``: a recording's codes from the string a voice file keeps
        (ChatTTS's ``Speaker.decode_prompt``; given by the engine that loaded ChatTTS)."""
        self.directory = Path(directory)
        self.dim = dim
        self._decode_sample = decode_sample
        self.limit = limit  # how many voices may be stored (None: no bound)
        self._sampler = sampler
        self._lock = threading.Lock()
        self._memo: dict[str, tuple[float, Voice]] = {}

    def names(self) -> list[str]:
        stored = set()
        if self.directory.is_dir():
            stored = {path.stem for path in self.directory.glob("*.json") if NAME.match(path.stem)}
        return sorted(stored | set(DEFAULT_VOICES))

    def listing(self) -> list[dict[str, Any]]:
        items = []
        for name in self.names():
            item: dict[str, Any] = {
                "name": name,
                "source": "file" if self._path(name).is_file() else "default",
            }
            if item["source"] == "file":
                try:
                    voice = self._single(name)
                except VoiceError:
                    continue  # removed meanwhile, or unreadable: not a voice to offer
                if voice.sample is not None:
                    item.update(id=voice.id, type="audio_sample", created_at=voice.created_at)
            items.append(item)
        return items

    def stored(self) -> int:
        if not self.directory.is_dir():
            return 0
        return sum(1 for path in self.directory.glob("*.json") if NAME.match(path.stem))

    def get(self, name: str) -> Voice:
        if not isinstance(name, str):
            raise VoiceError("'voice' must be a string")
        name = name.strip().lower()
        if "+" in name or "(" in name:
            return self.blend(name)
        return self._single(name)

    def resolve(self, name: str, field: str) -> Voice:
        """``get``, for the voice a request's ``field`` names: an error names the field."""
        try:
            return self.get(name)
        except VoiceError as error:
            raise error.named_in(field) from None

    def blend(self, spec: str) -> Voice:
        """``a(2)+b(1)``: the embeddings' weighted mean, weights normalised. Its name is the
        canonical spelling (normalised weights) and its digest that of the blended embedding,
        so the cache tells blends apart and one blend spelled two ways shares an entry."""
        parts = [part.strip() for part in spec.split("+")]
        if len(parts) > MAX_BLEND_PARTS:
            raise VoiceError(f"a blend has at most {MAX_BLEND_PARTS} voices")
        named = []
        for part in parts:
            match = BLEND_PART.match(part)
            if not match:
                raise VoiceError(
                    f"cannot read {part!r} in the blend {spec!r}: write voices as "
                    "name(weight)+name(weight), weights from 0 to 9999"
                )
            weight = float(match.group(2)) if match.group(2) is not None else 1.0
            named.append((match.group(1), weight))
        # every voice named must exist, weighted or not: an unknown name is the client's
        # mistake whatever its weight (a 400, not the 422 of a blend with no weight)
        voices = {name: self._single(name) for name, _ in named}
        total = sum(weight for _, weight in named)
        if total <= 0:
            raise UnusableBlend(f"the blend {spec!r} has no weight above 0")
        weights: dict[str, float] = {}  # a voice named twice adds up its weights
        for name, weight in named:
            weights[name] = weights.get(name, 0.0) + weight / total
        voices = {name: voice for name, voice in voices.items() if weights[name] > 0}
        for name, voice in voices.items():
            if voice.sample is not None:
                raise VoiceError(
                    f"{name!r} is made from a recording: ChatTTS speaks it from the recording's "
                    "codes, not from an embedding, so it cannot be blended"
                )
        embedding = sum(weights[name] * voices[name].embedding for name in sorted(voices))
        label = "+".join(f"{name}({weights[name]:.4g})" for name in sorted(voices))
        return Voice(label, embedding, digest(embedding))

    def _single(self, name: str) -> Voice:
        if VOICE_ID.match(name):
            name = self._name_of(name)
        seed = SEED_VOICE.match(name)
        if seed:
            digits = seed.group(1).lstrip("0") or "0"
            value = int(digits) if len(digits) <= len(str(MAX_SEED)) else MAX_SEED + 1
            if value > MAX_SEED:
                raise VoiceError(f"voice seed must be between 0 and {MAX_SEED}")
            return self.from_seed(value)
        if not NAME.match(name):
            raise VoiceError(
                "voice names are 1-64 characters of a-z, 0-9, '-' and '_', "
                "starting with a letter or digit; or 'seed:N'"
            )
        path = self._path(name)
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            if name in DEFAULT_VOICES:
                voice = self.from_seed(DEFAULT_VOICES[name])
                return Voice(name, voice.embedding, voice.digest)
            raise UnknownVoice(
                f"unknown voice {name!r}; voices: {', '.join(self.names())}, or seed:N"
            ) from None
        with self._lock:
            memo = self._memo.get(name)
            if memo is not None and memo[0] == mtime:
                return memo[1]
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            if "sample" in record:
                voice = self._sampled(name, record)
            else:
                embedding = decode_embedding(record["embedding"], self.dim)
                voice = Voice(name, embedding, digest(embedding))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise VoiceError(f"voice file for {name!r} is unusable: {error}") from None
        with self._lock:
            self._memo[name] = (mtime, voice)
        return voice

    def from_seed(self, seed: int) -> Voice:
        embedding = self._sampler(seed)
        return Voice(f"seed:{seed}", embedding, "")  # the seed alone defines it for this model

    def register(
        self,
        name: str,
        embedding_text: str | None = None,
        replace: bool = False,
        voice: str | None = None,
    ) -> Voice:
        """Store a voice under ``name``: from an embedding string, or from ``voice``, any
        voice this store resolves (a blend, ``seed:N``, another name)."""
        if not isinstance(name, str) or not NAME.match(name):
            raise VoiceError(
                "voice names are 1-64 characters of a-z, 0-9, '-' and '_', "
                "starting with a letter or digit"
            )
        if (embedding_text is None) == (voice is None):
            raise VoiceError("send either 'embedding' or 'voice' (a blend, seed:N or a name)")
        if voice is not None:
            source = self.resolve(voice, "voice")  # missing: the request's field at fault
            if source.sample is not None:
                raise VoiceError(
                    f"{source.name!r} is made from a recording and has no embedding to store; "
                    f"refer to it by its name or its id, {source.id}"
                )
            embedding = source.embedding
        elif embedding_text is not None:
            embedding = decode_embedding(embedding_text, self.dim)
        if VOICE_ID.match(name):
            raise VoiceError("names of the form voice_<24 hex digits> are voice ids")
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(name)
        with self._lock:
            if path.exists() and not replace:
                raise VoiceExists(f'voice {name!r} exists; send "replace": true to overwrite it')
            if not path.exists():
                self.check_room()
            self._forget_id(path)  # replacing a voice made from a recording
            record = {"name": name, "embedding": encode_embedding(embedding)}
            replace_atomically(path, lambda out: json.dump(record, out), binary=False, shared=False)
            self._memo.pop(name, None)
        return self.get(name)

    def create_from_sample(
        self, name: str, sample: SpeakerSample, prompt: str, consent: str
    ) -> Voice:
        """Store a voice made from a recording: ``prompt`` is ChatTTS's string of the sample's
        codes (``Speaker.encode_prompt``), ``consent`` the consent it was made under."""
        from secrets import token_hex

        if not isinstance(name, str) or not NAME.match(name):
            raise VoiceError(
                "'name' must be 1-64 characters of a-z, 0-9, '-' and '_', starting with a "
                "letter or digit: requests name the voice by it"
            )
        if VOICE_ID.match(name):
            raise VoiceError("names of the form voice_<24 hex digits> are voice ids")
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(name)
        with self._lock:
            if path.exists():
                raise VoiceExists(f"voice {name!r} exists; delete it or choose another name")
            self.check_room()
            voice_id = f"voice_{token_hex(12)}"
            record = {
                "id": voice_id,
                "object": "audio.voice",
                "name": name,
                "type": "audio_sample",
                "created_at": int(time.time()),
                "consent": consent,
                "sample": prompt,
                "transcript": sample.transcript,
            }
            ids = self.directory / "ids"
            ids.mkdir(exist_ok=True)
            # the voice, then its id: an id always names a voice that is there
            replace_atomically(path, lambda out: json.dump(record, out), binary=False, shared=False)
            try:
                replace_atomically(
                    ids / voice_id, lambda out: out.write(name), binary=False, shared=False
                )
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            self._memo.pop(name, None)
        return self.get(name)

    def delete(self, name: str) -> Voice:
        """Remove a stored voice, named or by its id; the voice it was."""
        if not isinstance(name, str):
            raise VoiceError("invalid voice name")
        name = name.strip().lower()
        if VOICE_ID.match(name):
            name = self._name_of(name)
        if not NAME.match(name):
            raise VoiceError("invalid voice name")
        path = self._path(name)
        if not path.is_file():
            raise UnknownVoice(f"no stored voice {name!r}")
        try:
            voice = self._single(name)
        except VoiceError:  # an unreadable file is still removed
            voice = Voice(name, None)
        with self._lock:
            self._forget_id(path)
            path.unlink(missing_ok=True)
            self._memo.pop(name, None)
        return voice

    def check_room(self) -> None:
        """Raise TooManyVoices when as many voices are stored as the server keeps."""
        if self.limit is not None and self.stored() >= self.limit:
            raise TooManyVoices(
                f"{self.limit} voices are stored, the most this server keeps "
                "(CHATTTS_MAX_STORED_VOICES); delete one first"
            )

    def _name_of(self, voice_id: str) -> str:
        try:
            return (self.directory / "ids" / voice_id).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise UnknownVoice(f"no voice with the id {voice_id!r}") from None

    def _forget_id(self, path: Path) -> None:
        """The id file of the voice stored at ``path``, if it was made from a recording."""
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(record, dict) and VOICE_ID.match(str(record.get("id", ""))):
            (self.directory / "ids" / record["id"]).unlink(missing_ok=True)

    def _sampled(self, name: str, record: dict[str, Any]) -> Voice:
        if self._decode_sample is None:
            raise VoiceError(f"voice {name!r} is made from a recording; none can be read here")
        codes = self._decode_sample(record["sample"])
        sample = SpeakerSample(codes, record.get("transcript") or "")
        return Voice(
            name,
            None,
            sample_digest(sample),
            sample=sample,
            id=record["id"],
            created_at=int(record.get("created_at", 0)),
        )

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.json"
