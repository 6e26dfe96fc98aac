"""Turn an HTTP request body into a SynthesisRequest, or a clear 4xx."""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Any

from chattts_service.api.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from chattts_service.config import Settings
from chattts_service.inference.types import SynthesisRequest
from chattts_service.services.audio import FORMATS, STREAM_FORMATS
from chattts_service.services.speech import Output
from chattts_service.services.text import TextError, check_refine_prompt, check_tokens
from chattts_service.services.voices import VoiceError

OPTION_FIELDS = {
    "seed",
    "voice",
    "speed",
    "temperature",
    "top_p",
    "top_k",
    "refine_text",
    "refine_prompt",
    "normalize",
    "stream",
}
SYNTHESIZE_FIELDS = {"text", "format"} | OPTION_FIELDS
SPEECH_FIELDS = {"model", "input", "response_format", "instructions"} | OPTION_FIELDS
# Model names an OpenAI client may send; they all mean the one model this service runs.
MODEL_IDS = ("chattts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
MAX_SEED = 2**31 - 1
_WHITESPACE = re.compile(r"\s+")


def json_body(content_type: str | None, raw: bytes) -> dict[str, Any]:
    import json

    if content_type != "application/json":
        raise UnsupportedMediaType("Content-Type must be application/json")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequest("body is not valid UTF-8") from None
    except ValueError as error:
        raise BadRequest(f"body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def normalise_text(text: str) -> str:
    """The canonical form of a text: it is what the model reads and what the cache keys on."""
    text = unicodedata.normalize("NFC", text)
    # Control characters other than whitespace carry no speech and confuse the tokenizer.
    text = "".join(ch for ch in text if ch.isspace() or unicodedata.category(ch) != "Cc")
    return _WHITESPACE.sub(" ", text).strip()


# The sampling knobs, with ChatTTS's defaults for speech codes and the ranges accepted.
TEMPERATURE = (0.3, 0.01, 2.0)
TOP_P = (0.7, 0.01, 1.0)
TOP_K = (20, 1, 100)
SPEED = (1.0, 0.25, 4.0)


def speed_level(speed: float) -> int:
    """OpenAI's speed (0.25-4.0, 1 = normal) -> ChatTTS's [speed_N] prompt level (0-9, 5 =
    normal): two levels per doubling, so 0.25 -> 1, 0.5 -> 3, 1 -> 5, 2 -> 7, 4 -> 9."""
    return max(0, min(9, round(5 + 2 * math.log2(speed))))


def _number(body, name, default, low, high, integer=False):
    value = body.get(name, None)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
    ):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}")
    if not math.isfinite(value) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low:g} and {high:g}")
    return value


def _flag(body, name, default):
    value = body.get(name, None)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false")
    return value


def _text(body, name, settings):
    if name not in body:
        raise BadRequest(f"'{name}' is required")
    text = body[name]
    if not isinstance(text, str):
        raise BadRequest(f"'{name}' must be a string")
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        raise BadRequest(f"'{name}' contains an unpaired UTF-16 surrogate")
    text = normalise_text(text)
    if not text:
        raise BadRequest(f"'{name}' must not be empty")
    if len(text) > settings.max_chars:
        raise PayloadTooLarge(
            f"'{name}' has {len(text)} characters; the limit is {settings.max_chars}"
        )
    try:
        check_tokens(text, settings.max_control_tokens)
    except TextError as error:
        raise BadRequest(str(error)) from None
    return text


def synthesis_options(
    body: dict[str, Any],
    settings: Settings,
    voices,
    *,
    text_field: str,
    format_field: str,
    default_format: str,
    accepted: set[str],
) -> tuple[SynthesisRequest, Output]:
    """The options /synthesize and /v1/audio/speech share, checked one by one."""
    unknown = sorted(set(body) - accepted)
    if unknown:
        raise BadRequest(
            f"unknown fields: {', '.join(unknown)}; accepted: {', '.join(sorted(accepted))}"
        )
    text = _text(body, text_field, settings)

    seed = _number(body, "seed", settings.default_seed, 0, MAX_SEED, integer=True)

    voice = None
    if body.get("voice") is not None:
        if voices is None:
            raise BadRequest("voices are not available until the model is loaded")
        try:
            voice = voices.get(body["voice"])
        except VoiceError as error:
            raise BadRequest(str(error)) from None

    audio_format = body.get(format_field)
    if audio_format is None:
        audio_format = default_format
    if not isinstance(audio_format, str) or audio_format not in FORMATS:
        raise BadRequest(f"'{format_field}' must be one of {', '.join(FORMATS)}")
    stream = _flag(body, "stream", False)
    if stream and audio_format not in STREAM_FORMATS:
        raise BadRequest(
            f"streaming sends {' or '.join(STREAM_FORMATS)}; "
            f"'{format_field}' {audio_format!r} cannot be streamed"
        )

    refine_prompt = body.get("refine_prompt") or ""
    if not isinstance(refine_prompt, str):
        raise BadRequest("'refine_prompt' must be a string")
    try:
        refine_prompt = check_refine_prompt(refine_prompt)
    except TextError as error:
        raise BadRequest(str(error)) from None
    refine_text = _flag(body, "refine_text", settings.refine_text)
    if refine_prompt and not refine_text:
        raise BadRequest("'refine_prompt' steers text refinement; set 'refine_text': true")

    request = SynthesisRequest(
        text=text,
        seed=seed,
        refine_text=refine_text,
        voice=voice,
        speed=speed_level(_number(body, "speed", *SPEED)),
        temperature=float(_number(body, "temperature", *TEMPERATURE)),
        top_p=float(_number(body, "top_p", *TOP_P)),
        top_k=_number(body, "top_k", *TOP_K, integer=True),
        normalize=_flag(body, "normalize", settings.normalize),
        refine_prompt=refine_prompt,
    )
    return request, Output(format=audio_format, stream=stream)


def synthesize_request(
    body: dict[str, Any], settings: Settings, voices=None
) -> tuple[SynthesisRequest, Output]:
    """POST /synthesize: WAV unless asked otherwise."""
    return synthesis_options(
        body,
        settings,
        voices,
        text_field="text",
        format_field="format",
        default_format="wav",
        accepted=SYNTHESIZE_FIELDS,
    )


def speech_request(
    body: dict[str, Any], settings: Settings, voices
) -> tuple[SynthesisRequest, Output]:
    """POST /v1/audio/speech: OpenAI's fields (MP3 by default), plus this service's options."""
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required")
    if model not in MODEL_IDS:
        raise BadRequest(f"unknown model {model!r}; models: {', '.join(MODEL_IDS)}")
    if "voice" not in body:
        raise BadRequest("'voice' is required")
    instructions = body.get("instructions")
    if instructions not in (None, ""):
        raise BadRequest(
            "'instructions' is not supported; ChatTTS is steered with control "
            "tokens in the text and 'refine_prompt'"
        )
    return synthesis_options(
        body,
        settings,
        voices,
        text_field="input",
        format_field="response_format",
        default_format="mp3",
        accepted=SPEECH_FIELDS,
    )
