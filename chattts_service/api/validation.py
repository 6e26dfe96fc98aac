"""Turn an HTTP request body into a SynthesisRequest, or a clear 4xx."""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass, replace
from typing import Any

from chattts_service.api.errors import (
    BadRequest,
    PayloadTooLarge,
    UnsupportedMediaType,
    from_voice_error,
)
from chattts_service.config import MAX_SEED, Settings
from chattts_service.domain.text import (
    TextError,
    check_refine_prompt,
    check_tokens,
    normalise_text,
)
from chattts_service.domain.voices import VoiceError
from chattts_service.inference.types import CODE_SAMPLING, SynthesisRequest
from chattts_service.services.audio import FORMATS, STREAM_FORMATS
from chattts_service.services.captions import CAPTION_FORMATS
from chattts_service.services.speech import Output

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
    "stream_format",
}
STREAM_FORMAT_CHOICES = ("audio", "sse")  # OpenAI's: raw audio, or Server-Sent Events
SYNTHESIZE_FIELDS = {"text", "format"} | OPTION_FIELDS
SPEECH_FIELDS = {"model", "input", "response_format", "instructions"} | OPTION_FIELDS
# Model names an OpenAI client may send; they all mean the one model this service runs.
# OpenAI's free-text voice instructions: taken (and not applied) up to this length
MAX_INSTRUCTIONS_CHARS = 4096
MODEL_IDS = ("chattts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")


# no body of this API nests deeper than a few levels; the limit holds whatever the Python
# version's parser would take (3.11's recursion limit stops near 1,000 levels, 3.13's does not)
MAX_JSON_DEPTH = 32


def _nested_too_deeply(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays and objects in ``text`` nest more than ``limit`` deep (brackets inside
    strings do not count)."""
    if text.count("[") + text.count("{") <= limit:  # cannot: most bodies stop here
        return False
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def json_body(content_type: str | None, raw: bytes) -> dict[str, Any]:
    if content_type != "application/json":
        raise UnsupportedMediaType("Content-Type must be application/json")
    try:
        text = raw.decode("utf-8")
        if _nested_too_deeply(text):
            raise RecursionError
        body = json.loads(text)
    except UnicodeDecodeError:
        raise BadRequest("body is not valid UTF-8") from None
    except ValueError as error:
        raise BadRequest(f"body is not valid JSON: {error}") from None
    except RecursionError:  # deeply nested arrays or objects
        raise BadRequest("body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


@dataclass(frozen=True)
class NumberField:
    """A numeric option: what validation enforces and what the OpenAPI document states, from
    one declaration. An integer field takes integral JSON numbers (4 and 4.0), as JSON Schema
    does; null means the default."""

    name: str
    default: float | None
    low: float
    high: float
    integer: bool
    description: str

    def parse(self, body: dict[str, Any], default=None):
        value = body.get(self.name)
        if value is None:
            return self.default if default is None else default
        kind = "an integer" if self.integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"'{self.name}' must be {kind}")
        if self.integer:
            value = integral(value)
            if not isinstance(value, int):
                raise BadRequest(f"'{self.name}' must be {kind}")
        if not math.isfinite(value) or not self.low <= value <= self.high:
            raise BadRequest(
                f"'{self.name}' must be between {number_text(self.low)} and "
                f"{number_text(self.high)}"
            )
        return value

    def schema(self, default=None) -> dict:
        schema = {
            "type": ["integer" if self.integer else "number", "null"],
            "minimum": self.low,
            "maximum": self.high,
            "description": self.description,
        }
        if (default if default is not None else self.default) is not None:
            schema["default"] = default if default is not None else self.default
        return schema


def integral(value):
    """An integral JSON number as an int (4.0 -> 4), as JSON Schema counts it an integer;
    anything else unchanged, for its own check to refuse."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def number_text(value: float) -> str:
    """A bound as people write it: 2147483647, not 2.14748e+09; 0.25, not 0.250000."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


# The sampling knobs, with ChatTTS's defaults for speech codes and the ranges accepted.
TEMPERATURE = NumberField(
    "temperature",
    CODE_SAMPLING.temperature,
    0.01,
    2.0,
    False,
    "Sampling temperature of the speech codes.",
)
TOP_P = NumberField("top_p", CODE_SAMPLING.top_p, 0.01, 1.0, False, "Nucleus sampling threshold.")
TOP_K = NumberField("top_k", CODE_SAMPLING.top_k, 1, 100, True, "Top-k sampling.")
SPEED = NumberField(
    "speed",
    1.0,
    0.25,
    4.0,
    False,
    "1 = normal. Mapped onto ChatTTS's [speed_0]..[speed_9] prompt (two levels "
    "per doubling: 0.5 -> 3, 1 -> 5, 2 -> 7, 4 -> 9); the model's own pace range "
    "is narrower than the numbers say.",
)
SEED = NumberField(
    "seed",
    None,
    0,
    MAX_SEED,
    True,
    "Sampling seed (and the voice when 'voice' is absent); the server's "
    "CHATTTS_DEFAULT_SEED when absent.",
)


def speed_level(speed: float) -> int:
    """OpenAI's speed (0.25-4.0, 1 = normal) -> ChatTTS's [speed_N] prompt level (0-9, 5 =
    normal): two levels per doubling, so 0.25 -> 1, 0.5 -> 3, 1 -> 5, 2 -> 7, 4 -> 9."""
    return max(0, min(9, round(5 + 2 * math.log2(speed))))


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
    if len(text) > settings.max_chars:  # code points, as JSON Schema's maxLength counts
        raise PayloadTooLarge(
            f"'{name}' has {len(text)} characters; the limit is {settings.max_chars}"
        )
    try:
        # as sent: "[lau\x01gh]" is not "[laugh]", though removing control characters (below)
        # would make it one; the OpenAPI document's pattern reads the text as sent too
        check_tokens(unicodedata.normalize("NFC", text), settings.max_control_tokens)
    except TextError as error:
        raise BadRequest(str(error)) from None
    text = normalise_text(text)
    if not text:
        raise BadRequest(f"'{name}' must not be empty")
    return text


def voice_reference(value: Any) -> Any:
    """A voice as a string, or as OpenAI's voice object ``{"id": "..."}`` (any voice's name
    or id): the string either way. Anything else is handed on for the voice store to refuse."""
    if isinstance(value, dict):
        if set(value) != {"id"} or not isinstance(value["id"], str):
            raise BadRequest('a \'voice\' object must be {"id": "<a voice\'s name or id>"}')
        return value["id"]
    return value


# Long: one check per field, in the order of the README's field table.
def synthesis_options(
    body: dict[str, Any],
    settings: Settings,
    voices,
    *,
    text_field: str,
    format_field: str,
    default_format: str,
    accepted: set[str],
    default_stream: bool = False,
) -> tuple[SynthesisRequest, Output]:
    """The options /synthesize and /v1/audio/speech share, checked one by one. Without a
    ``stream`` field, a format that streams is streamed when ``default_stream``."""
    unknown = sorted(set(body) - accepted)
    if unknown:
        raise BadRequest(
            f"unknown fields: {', '.join(unknown)}; accepted: {', '.join(sorted(accepted))}"
        )
    text = _text(body, text_field, settings)

    seed = SEED.parse(body, settings.default_seed)

    voice = None
    if body.get("voice") is not None:
        if voices is None:
            raise BadRequest("voices are not available until the model is loaded")
        try:
            voice = voices.get(voice_reference(body["voice"]))
        except VoiceError as error:
            raise from_voice_error(error, in_field=True) from None

    audio_format = body.get(format_field)
    if audio_format is None:
        audio_format = default_format
    if not isinstance(audio_format, str) or audio_format not in FORMATS:
        raise BadRequest(f"'{format_field}' must be one of {', '.join(FORMATS)}")
    stream = _flag(body, "stream", None)
    if stream and audio_format not in STREAM_FORMATS:
        raise BadRequest(
            f"streaming sends {' or '.join(STREAM_FORMATS)}; "
            f"'{format_field}' {audio_format!r} cannot be streamed"
        )

    refine_prompt = body.get("refine_prompt")
    if refine_prompt is None:
        refine_prompt = ""
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
        speed=speed_level(SPEED.parse(body)),
        temperature=float(TEMPERATURE.parse(body)),
        top_p=float(TOP_P.parse(body)),
        top_k=TOP_K.parse(body),
        normalize=_flag(body, "normalize", settings.normalize),
        refine_prompt=refine_prompt,
    )
    stream_format = body.get("stream_format")
    if stream_format is not None and stream_format not in STREAM_FORMAT_CHOICES:
        raise BadRequest(f"'stream_format' must be one of {', '.join(STREAM_FORMAT_CHOICES)}")
    # asked for: chunks from the first steps on; by default, a segment at a time (as cheap as
    # a whole answer)
    early = bool(stream) or stream_format is not None
    if stream is None:
        stream = default_stream and audio_format in STREAM_FORMATS
    events = stream_format == "sse"
    # events carry the audio as it is decoded where the format streams, else the whole file
    stream = stream or (events and audio_format in STREAM_FORMATS)
    return request, Output(format=audio_format, stream=stream, events=events, early=early)


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


def captioned_speech_request(
    body: dict[str, Any], settings: Settings, voices
) -> tuple[SynthesisRequest, Output]:
    """POST /v1/audio/captioned_speech: the /v1/audio/speech body plus ``caption_format``;
    answered whole, every sentence read as its own segment so the captions are exact."""
    caption_format = body.get("caption_format")
    if caption_format is None:
        caption_format = "json"
    if caption_format not in CAPTION_FORMATS:
        raise BadRequest(f"'caption_format' must be one of {', '.join(CAPTION_FORMATS)}")
    for name in ("stream", "stream_format"):
        if body.get(name) not in (None, False, "audio"):
            raise BadRequest(f"captioned speech is answered whole: '{name}' cannot be used here")
    request, output = speech_request(body, settings, voices, SPEECH_FIELDS | {"caption_format"})
    return (
        replace(request, sentence_segments=True),
        Output(format=output.format, stream=False, captions=caption_format),
    )


def speech_request(
    body: dict[str, Any], settings: Settings, voices, accepted: set[str] = SPEECH_FIELDS
) -> tuple[SynthesisRequest, Output]:
    """POST /v1/audio/speech: OpenAI's fields (MP3 by default, streamed unless
    ``"stream": false`` or FLAC, as OpenAI's endpoint answers), plus this service's options."""
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required")
    if model not in MODEL_IDS:
        raise BadRequest(f"unknown model {model!r}; models: {', '.join(MODEL_IDS)}")
    if body.get("voice") is None:
        raise BadRequest("'voice' is required")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string")
    if instructions and len(instructions) > MAX_INSTRUCTIONS_CHARS:
        raise BadRequest(f"'instructions' is longer than {MAX_INSTRUCTIONS_CHARS} characters")
    if instructions and settings.instructions == "refuse":
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
        accepted=accepted,
        default_stream=True,
    )
