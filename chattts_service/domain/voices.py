"""Named voices, the values: speaker embeddings, so a name sounds the same on every call.

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

Names are checked against a strict pattern before they come near a path. The embeddings'
string codec is in ``embeddings``, the store that keeps voices as files in ``voice_store``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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
BLEND_WEIGHT = r"(?:\d{1,4}(?:\.\d{1,6})?|\.\d{1,6})"  # 0 to 9999.999999
BLEND_PART = re.compile(rf"^([a-z0-9][a-z0-9_:-]{{0,63}})(?:\(({BLEND_WEIGHT})\))?$")


@dataclass(frozen=True)
class SpeakerSample:
    """A voice made from a recording: ChatTTS's speaker prompt (``spk_smp``), the DVAE's codes
    of the recording ``[num_vq, frames]``, and the words spoken in it (``txt_smp``; "" when
    not given). The prompt puts the transcript before the text and the codes after it."""

    codes: Any = field(repr=False)  # int32 torch tensor (the domain does not import torch)
    transcript: str = ""
    # upstream's long-text mode speaks with both: the voice's embedding and its first segment
    embedding: Any = field(default=None, repr=False)


class VoiceError(ValueError):
    """A voice name or embedding that cannot be used; the message says why. ``field``: the
    request's field that named the voice, where a request named it (a speech request's
    ``voice``), else None (the voice's own route)."""

    field: str | None = None

    def named_in(self, field: str) -> VoiceError:
        self.field = field
        return self


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
    embedding: Any = field(compare=False, repr=False)  # float32 torch tensor [hidden]
    digest: str = ""  # sha256 of the embedding (or of the sample): part of the cache key
    sample: SpeakerSample | None = field(default=None, compare=False, repr=False)
    id: str = ""  # a voice made from a recording: its OpenAI id
    created_at: int = 0

    @property
    def speaker(self) -> Any:
        """What a prompt carries: the speaker prompt of a recording, else the embedding."""
        return self.sample if self.sample is not None else self.embedding

    def describe(self) -> dict[str, Any]:
        if self.sample is None:
            return {"name": self.name, "digest": self.digest}
        return {
            "id": self.id,
            "object": "audio.voice",
            "name": self.name,
            "created_at": self.created_at,
            "type": "audio_sample",
        }
