"""Every JSON answer the API gives, declared once: the OpenAPI document's answer schemas are
these models' (``openapi.py``), and the handlers build their answers from them. An answer may
carry more fields than listed (``Answer``); the listed ones are always there."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, WithJsonSchema

from chattts_service.api.models import AudioFormat


class Answer(BaseModel):
    """A JSON answer: the fields listed are always there; more may be added."""

    model_config = ConfigDict(extra="allow")


class Error(Answer):
    error: str


class OpenAIErrorDetail(Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(Answer):
    error: OpenAIErrorDetail


class Caption(Answer):
    start: float = Field(description="seconds into the audio")
    end: float
    text: str = Field(description="the sentence as sent")
    spoken_text: str = Field(description="as the model read it (normalised)")
    start_sample: int = Field(
        description="samples at the audio's rate (24 kHz unless sample_rate asks): exact at 24 kHz"
    )
    end_sample: int
    speaker: str | None = Field(
        default=None,
        description="the voice that says it: in SSML with <voice> and in dialogue turns",
    )


Base64 = Annotated[str, WithJsonSchema({"type": "string", "contentEncoding": "base64"})]


class CaptionedSpeech(Answer):
    audio: Base64
    format: AudioFormat
    content_type: str
    seconds: float
    captions: list[Caption]
    srt: str | None = None
    vtt: str | None = None


class SpeechAudioDelta(Answer):
    type: Literal["speech.audio.delta"] = "speech.audio.delta"
    audio: Base64


class Usage(Answer):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class SpeechAudioDone(Answer):
    type: Literal["speech.audio.done"] = "speech.audio.done"
    usage: Usage


class Model(Answer):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(Answer):
    object: Literal["list"] = "list"
    data: list[Model]


class NamedVoice(Answer):
    name: str
    digest: str


class SampledVoice(Answer):
    id: str
    object: Literal["audio.voice"] = "audio.voice"
    name: str
    created_at: int
    type: Literal["audio_sample"] = "audio_sample"


class Voice(RootModel[NamedVoice | SampledVoice]):
    """A stored voice: a named one (embedding, blend) or one made from a recording (OpenAI's
    Voice object)."""


class ListedVoice(Answer):
    name: str
    source: Literal["file", "default"] = Field(
        description="file: stored in CHATTTS_VOICES_DIR; default: one of OpenAI's names"
    )
    id: str | None = None
    type: Literal["audio_sample"] | None = None
    created_at: int | None = None


class VoiceList(Answer):
    voices: list[str]
    details: list[ListedVoice]
    seed_voices: str


class VoiceDeleted(Answer):
    id: str
    object: Literal["audio.voice.deleted"] = "audio.voice.deleted"
    deleted: bool
    name: str


class VoiceConsent(Answer):
    id: str
    object: Literal["audio.voice_consent"] = "audio.voice_consent"
    name: str
    language: str
    created_at: int


class VoiceConsentList(Answer):
    object: Literal["list"] = "list"
    data: list[VoiceConsent]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VoiceConsentDeleted(Answer):
    id: str
    object: Literal["audio.voice_consent"] = "audio.voice_consent"
    deleted: bool


class Limit(Answer):
    min: int
    max: int | None


class Tuning(Answer):
    current: dict[str, int]
    limits: dict[str, Limit] | None = None
    scheduling: list[str] | None = Field(
        None, description="The order in which the scheduler gives rows, rule by rule"
    )


class Alive(Answer):
    status: Literal["alive"] = "alive"


class Ready(Answer):
    status: str = Field(description="ready, or the phase: loading, downloading, warming up, ...")
    model: str | None = None
    phase: str | None = None
    error: str | None = None
