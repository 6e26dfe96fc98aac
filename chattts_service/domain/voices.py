"""Named voices: speaker embeddings kept as files, so a name sounds the same on every call.

A voice is one of
- a file ``<name>.json`` in ``CHATTTS_VOICES_DIR`` holding a ChatTTS speaker embedding string
  (the ``spk_emb`` string ChatTTS's ``sample_random_speaker`` and its community tools produce);
  clients register them with ``POST /v1/audio/voices``;
- a shipped default: the OpenAI names map to fixed seeds, drawn from the loaded model's speaker
  statistics (a file with the same name takes precedence);
- ``seed:N``: the voice drawn from seed N, without touching the global RNG;
- a blend ``name(weight)+name(weight)`` of any of these (Kokoro-FastAPI's form): the weighted
  mean of their embeddings, weights normalised to sum to 1 (a part without a weight counts 1);
- a voice made from a recording (OpenAI's ``POST /v1/audio/voices`` with an audio sample):
  ``<name>.json`` holds ChatTTS's speaker prompt of the recording (``spk_smp``) and its
  transcript instead of an embedding, and the id OpenAI clients refer to it by
  (``voice_...``; ``ids/<id>`` names the voice it belongs to). It has no embedding, so it
  cannot be blended.

Names are checked against a strict pattern before they come near a path.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from chattts_service.config import MAX_SEED
from chattts_service.runtime.files import replace_atomically

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
SEED_VOICE = re.compile(r"^seed:(\d+)$")
VOICE_ID = re.compile(r"^voice_[0-9a-f]{24}$")  # a voice made from a recording, as OpenAI's
# a real embedding is ~1,000 characters; the bound keeps the longest valid body under 64 KiB
MAX_EMBEDDING_CHARS = 4096
# OpenAI's 13 built-in voice names -> the seeds their embeddings are drawn from (each its own
# voice; a test reads the names from the installed openai package)
DEFAULT_VOICES = {
    "alloy": 2222,
    "ash": 3301,
    "ballad": 4417,
    "coral": 5531,
    "echo": 7869,
    "fable": 6653,
    "marin": 8819,
    "cedar": 9907,
    "nova": 5099,
    "onyx": 4099,
    "sage": 6173,
    "shimmer": 1111,
    "verse": 7243,
}
MAX_BLEND_PARTS = 8
# one part of a blend: a voice, then optionally its weight in parentheses (0 to 9999.999999)
BLEND_PART = re.compile(r"^([a-z0-9][a-z0-9_:-]{0,63})(?:\((\d{1,4}(?:\.\d{1,6})?|\.\d{1,6})\))?$")


@dataclass(frozen=True)
class SpeakerSample:
    """A voice made from a recording: ChatTTS's speaker prompt (``spk_smp``), the DVAE's codes
    of the recording ``[num_vq, frames]``, and the words spoken in it (``txt_smp``; "" when
    not given). The prompt puts the transcript before the text and the codes after it."""

    codes: object = field(repr=False)  # int32 torch tensor
    transcript: str = ""
    # upstream's long-text mode speaks with both: the voice's embedding and its first segment
    embedding: object = field(default=None, repr=False)


class VoiceError(ValueError):
    """A voice name or embedding that cannot be used; the message says why."""


class NotAnEmbedding(VoiceError):
    """A well-formed string that does not decode to this model's speaker embedding."""


class VoiceExists(VoiceError):
    """A voice of that name is stored and the request did not ask to replace it."""


class UnknownVoice(VoiceError):
    pass


class UnusableBlend(VoiceError):
    """A well-formed blend whose weights are all 0."""


class TooManyVoices(VoiceError):
    """As many voices are stored as the server keeps."""


@dataclass(frozen=True)
class Voice:
    name: str
    embedding: object = field(compare=False, repr=False)  # float32 torch tensor [hidden]
    digest: str = ""  # sha256 of the embedding (or of the sample): part of the cache key
    sample: SpeakerSample | None = field(default=None, compare=False, repr=False)
    id: str = ""  # a voice made from a recording: its OpenAI id
    created_at: int = 0

    @property
    def speaker(self):
        """What a prompt carries: the speaker prompt of a recording, else the embedding."""
        return self.sample if self.sample is not None else self.embedding

    def describe(self) -> dict:
        if self.sample is None:
            return {"name": self.name, "digest": self.digest}
        return {
            "id": self.id,
            "object": "audio.voice",
            "name": self.name,
            "created_at": self.created_at,
            "type": "audio_sample",
        }


def decode_embedding(text: str, dim: int):
    """A ChatTTS speaker embedding string -> float32 tensor [dim], or VoiceError."""
    import pybase16384 as b14
    import torch

    if not isinstance(text, str) or not text:
        raise VoiceError("'embedding' must be a non-empty string")
    if len(text) > MAX_EMBEDDING_CHARS:
        raise VoiceError(f"'embedding' is longer than {MAX_EMBEDDING_CHARS} characters")
    try:
        raw = lzma.decompress(
            b14.decode_from_string(text),
            format=lzma.FORMAT_RAW,
            filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}],
        )
    except Exception:
        raise NotAnEmbedding("'embedding' is not a ChatTTS speaker embedding string") from None
    if len(raw) != dim * 2:
        raise NotAnEmbedding(
            f"'embedding' has {len(raw) // 2} values; this model's voices have {dim}"
        )
    values = np.frombuffer(raw, dtype=np.float16).astype(np.float32)
    if not np.isfinite(values).all():
        raise NotAnEmbedding("'embedding' holds non-finite values")
    return torch.from_numpy(values.copy())


def encode_embedding(embedding) -> str:
    """The inverse of ``decode_embedding`` (ChatTTS's own string format)."""
    import pybase16384 as b14

    raw = embedding.detach().to("cpu").numpy().astype(np.float16).tobytes()
    packed = lzma.compress(
        raw,
        format=lzma.FORMAT_RAW,
        filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}],
    )
    return b14.encode_to_string(packed)


def _digest(embedding) -> str:
    return hashlib.sha256(embedding.numpy().astype("<f4").tobytes()).hexdigest()[:32]


def _sample_digest(sample: SpeakerSample) -> str:
    data = sample.codes.numpy().astype("<u2").tobytes() + sample.transcript.encode("utf-8")
    return hashlib.sha256(data).hexdigest()[:32]


class VoiceStore:
    """Resolves voice names; ``sampler(seed)`` draws a seed's voice from the loaded model."""

    def __init__(
        self,
        directory: Path,
        dim: int,
        sampler,
        limit: int | None = None,
        decode_sample=None,
    ):
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

    def listing(self) -> list[dict]:
        items = []
        for name in self.names():
            item = {"name": name, "source": "file" if self._path(name).is_file() else "default"}
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
        total = sum(weight for _, weight in named)
        if total <= 0:
            raise UnusableBlend(f"the blend {spec!r} has no weight above 0")
        weights: dict[str, float] = {}  # a voice named twice adds up its weights
        for name, weight in named:
            weights[name] = weights.get(name, 0.0) + weight / total
        voices = {name: self._single(name) for name in weights if weights[name] > 0}
        for name, voice in voices.items():
            if voice.sample is not None:
                raise VoiceError(
                    f"{name!r} is made from a recording: ChatTTS speaks it from the recording's "
                    "codes, not from an embedding, so it cannot be blended"
                )
        embedding = sum(weights[name] * voices[name].embedding for name in sorted(voices))
        label = "+".join(f"{name}({weights[name]:.4g})" for name in sorted(voices))
        return Voice(label, embedding, _digest(embedding))

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
                voice = Voice(name, embedding, _digest(embedding))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise VoiceError(f"voice file for {name!r} is unusable: {error}") from None
        with self._lock:
            self._memo[name] = (mtime, voice)
        return voice

    def from_seed(self, seed: int) -> Voice:
        embedding = self._sampler(seed)
        return Voice(f"seed:{seed}", embedding, "")  # the seed alone defines it for this model

    def register(
        self, name: str, embedding_text: str | None = None, replace: bool = False, voice=None
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
            source = self.get(voice)
            if source.sample is not None:
                raise VoiceError(
                    f"{source.name!r} is made from a recording and has no embedding to store; "
                    f"refer to it by its name or its id, {source.id}"
                )
            embedding = source.embedding
        else:
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

    def create_from_sample(self, name, sample: SpeakerSample, prompt: str, consent: str) -> Voice:
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
            record = {
                "id": f"voice_{token_hex(12)}",
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
                    ids / record["id"], lambda out: out.write(name), binary=False, shared=False
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

    def _sampled(self, name: str, record: dict) -> Voice:
        if self._decode_sample is None:
            raise VoiceError(f"voice {name!r} is made from a recording; none can be read here")
        codes = self._decode_sample(record["sample"])
        sample = SpeakerSample(codes, record.get("transcript") or "")
        return Voice(
            name,
            None,
            _sample_digest(sample),
            sample=sample,
            id=record["id"],
            created_at=int(record.get("created_at", 0)),
        )

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.json"
