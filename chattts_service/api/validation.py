"""Turn an HTTP request body into what the service works with, or a clear 4xx.

The bodies are declared in ``models.py``; here the JSON is read, checked against its model, and
pydantic's findings are said in this service's words (one message per request: an unknown
field first, then the first field in the body's order).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any, Protocol, TypeVar, cast, get_args

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from chattts_service.api.errors import (
    ApiError,
    BadRequest,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from chattts_service.api.models import (
    SPEED_RANGE,
    TOO_LARGE,
    CaptionedSpeechFields,
    OpenAISpeechFields,
    SpeechFields,
    SynthesizeFields,
    choices,
    speech_bodies,
)
from chattts_service.config import Settings
from chattts_service.domain import ssml
from chattts_service.domain.speech import Silence, SynthesisRequest
from chattts_service.domain.text import NORMALISER, TextError, check_tokens
from chattts_service.domain.voices import Voice
from chattts_service.services.audio import STREAM_FORMATS
from chattts_service.services.speech import Output

# no body of this API nests deeper than a few levels; the limit holds whatever the Python
# version's parser would take (3.11's recursion limit stops near 1,000 levels, 3.13's does not)
MAX_JSON_DEPTH = 32
# the fields whose length is the request's size: over the limit is a 413, not a 400
TEXT_FIELDS = ("text", "input")
M = TypeVar("M", bound=BaseModel)


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


def parse(model: type[M], data: Any, what: str = "fields") -> M:
    """``data`` as ``model``, or the clearest single reason it is not one."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        details = [dict(detail) for detail in error.errors(include_url=False)]
        raise _refusal(model, details, what) from None


def _refusal(model: type[BaseModel], errors: list[dict[str, Any]], what: str) -> ApiError:
    unknown = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        accepted = ", ".join(sorted(model.model_fields))
        return BadRequest(
            f"unknown {what}: {', '.join(unknown)}; accepted: {accepted}", param=unknown[0]
        )
    order = list(model.model_fields)
    first = min(
        errors,
        key=lambda e: order.index(e["loc"][0]) if e["loc"] and e["loc"][0] in order else -1,
    )
    refusal = _say(model, first)
    if first["loc"] and first["loc"][0] in order:
        refusal.param = str(first["loc"][0])
    return refusal


def _say(model: type[BaseModel], error: dict[str, Any]) -> ApiError:
    kind, context = error["type"], error.get("ctx") or {}
    name = str(error["loc"][0]) if error["loc"] else None
    field = model.model_fields.get(name) if name else None
    if kind == TOO_LARGE:
        return PayloadTooLarge(error["msg"])
    if name is None or field is None:  # a rule across fields: the message names them
        return BadRequest(error["msg"])
    if kind == "missing":
        return BadRequest(f"'{name}' is required")
    if kind in ("string_too_long", "too_long"):
        length, limit = len(error["input"]), context["max_length"]
        if name in TEXT_FIELDS:
            return PayloadTooLarge(f"'{name}' has {length} characters; the limit is {limit}")
        return BadRequest(f"'{name}' is longer than {limit} characters")
    if kind in ("string_too_short", "too_short"):
        return BadRequest(f"'{name}' must not be empty")
    if kind == "string_unicode":  # pydantic cannot count what it cannot read
        return BadRequest(f"'{name}' contains an unpaired UTF-16 surrogate")
    if kind == "string_type":
        return BadRequest(f"'{name}' must be a string")
    if kind == "bool_type":
        return BadRequest(f"'{name}' must be true or false")
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return BadRequest(f"'{name}' must be an integer")
    if kind in ("float_type", "float_parsing"):
        return BadRequest(f"'{name}' must be a number")
    if kind in ("greater_than_equal", "less_than_equal", "finite_number"):
        low, high = _bounds(field)
        if low is None:
            return BadRequest(error["msg"])
        if high is None:
            return BadRequest(f"'{name}' must be at least {number_text(low)}")
        return BadRequest(f"'{name}' must be between {number_text(low)} and {number_text(high)}")
    if kind == "literal_error":
        allowed = [_json(value) for value in choices(field.annotation)]
        return BadRequest(f"'{name}' must be one of {', '.join(allowed)}")
    return BadRequest(error["msg"])  # ours (models.refuse), word for word


def _bounds(field: FieldInfo) -> tuple[float | None, float | None]:
    """A numeric field's ``ge`` and ``le``, wherever ``Annotated`` and ``| None`` put them."""
    found: dict[str, float] = {}

    def visit(item: Any) -> None:
        if isinstance(item, annotated_types.Ge):
            found.setdefault("ge", cast(float, item.ge))
        elif isinstance(item, annotated_types.Le):
            found.setdefault("le", cast(float, item.le))
        elif isinstance(item, FieldInfo):
            for constraint in item.metadata:
                visit(constraint)
        else:
            for arg in get_args(item):
                visit(arg)

    for item in (*field.metadata, field.annotation):
        visit(item)
    return found.get("ge"), found.get("le")


def _json(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def number_text(value: float) -> str:
    """A bound as people write it: 2147483647, not 2.14748e+09; 0.25, not 0.250000."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def speed_level(speed: float) -> int:
    """OpenAI's speed (0.25-4.0, 1 = normal) -> ChatTTS's [speed_N] prompt level (0-9, 5 =
    normal): two levels per doubling, so 0.25 -> 1, 0.5 -> 3, 1 -> 5, 2 -> 7, 4 -> 9."""
    return max(0, min(9, round(5 + 2 * math.log2(speed))))


class Voices(Protocol):
    """What resolves a request's voice (the voice service, or a store in tests)."""

    def resolve(self, name: str, field: str) -> Voice: ...


def _voice(voices: Voices | None, name: str, field: str) -> Voice:
    if voices is None:
        raise BadRequest("voices are not available until the model is loaded")
    return voices.resolve(name, field)


def _script(
    text: str,
    base: SynthesisRequest,
    speed: float,
    voices: Voices | None,
    field: str,
    room: int,
    max_tokens: int,
) -> list[SynthesisRequest | Silence]:
    """A text as a script's parts: SSML's spans and breaks (each span in its voice, pace and
    language), or the text as one span. ``room``: the characters it may hold; ``max_tokens``:
    the inline control tokens."""
    if not ssml.is_ssml(text):
        return [replace(base, text=text, speed=speed_level(speed))]
    try:
        read = ssml.parse(text, room, NORMALISER)
    except ssml.SsmlTooLong as error:
        raise PayloadTooLarge(f"'{field}': {error}", param=field) from None
    except ssml.SsmlError as error:
        raise BadRequest(
            f"'{field}' is not SSML this service reads: {error}", param=field
        ) from None
    try:
        check_tokens(" ".join(p.text for p in read if isinstance(p, ssml.Span)), max_tokens)
    except TextError as error:
        raise BadRequest(f"'{field}': {error}", param=field) from None
    parts: list[SynthesisRequest | Silence] = []
    for part in read:
        if isinstance(part, ssml.Pause):
            parts.append(Silence(part.milliseconds))
            continue
        low, high = SPEED_RANGE
        pace = min(high, max(low, (part.speed or speed) * part.factor))
        parts.append(
            replace(
                base,
                text=part.text,
                voice=_voice(voices, part.voice, field) if part.voice else base.voice,
                speed=speed_level(pace),
                language=part.language,
            )
        )
    return parts


def _spoken(
    body: SpeechFields,
    text: str | None,
    field: str,
    base: SynthesisRequest,
    voices: Voices | None,
    settings: Settings,
) -> SynthesisRequest:
    """The request: its text (in ``field``), or a script (SSML, or the dialogue's turns)."""
    if body.turns is None:
        assert text is not None  # the body has one or the other
        parts = _script(
            text, base, body.speed, voices, field, settings.max_chars, settings.max_control_tokens
        )
    else:
        parts = []
        spoken = 0
        for index, turn in enumerate(body.turns):
            where = f"turns[{index}]"
            if index:
                parts.append(Silence(body.turn_gap_ms))
            voice = _voice(voices, turn.voice, f"{where}.voice") if turn.voice else base.voice
            room = settings.max_chars - spoken
            turn_parts = _script(
                turn.input,
                replace(base, voice=voice),
                turn.speed or body.speed,
                voices,
                f"{where}.input",
                max(room, 0),
                settings.max_control_tokens,
            )
            parts += turn_parts
            spoken += sum(len(p.text) for p in turn_parts if isinstance(p, SynthesisRequest))
            if spoken > settings.max_chars:
                raise PayloadTooLarge(
                    f"the turns have {spoken} characters or more; the limit is "
                    f"{settings.max_chars}",
                    param="turns",
                )
    spans = [part for part in parts if isinstance(part, SynthesisRequest)]
    if len(parts) == 1:
        return spans[0]
    return replace(base, text=" ".join(span.text for span in spans), parts=tuple(parts))


def _speech(
    body: SpeechFields,
    text: str | None,
    field: str,
    voices: Voices | None,
    settings: Settings,
    *,
    default_stream: bool,
) -> tuple[SynthesisRequest, Output]:
    """A validated speech body -> the synthesis request and how to answer it. Without a
    ``stream`` field, a format that streams is streamed when ``default_stream``."""
    voice = _voice(voices, body.voice, "voice") if body.voice is not None else None
    base = SynthesisRequest(
        text="",
        seed=body.seed,
        refine_text=body.refine_text,
        voice=voice,
        speed=speed_level(body.speed),
        temperature=float(body.temperature),
        top_p=float(body.top_p),
        top_k=body.top_k,
        normalize=body.normalize,
        refine_prompt=body.refine_prompt,
    )
    request = _spoken(body, text, field, base, voices, settings)
    audio_format, asked = body.audio_format, body.model_fields_set
    stream_format = body.stream_format if "stream_format" in asked else None
    if "stream" in asked:
        stream = body.stream
    else:
        stream = default_stream and audio_format in STREAM_FORMATS
    events = stream_format == "sse"
    # events carry the audio as it is decoded where the format streams, else the whole file
    stream = stream or (events and audio_format in STREAM_FORMATS)
    asked_to_stream = ("stream" in asked and body.stream) or stream_format is not None
    return request, Output(
        format=audio_format,
        stream=stream,
        events=events,
        priority=body.priority,
        by_default=stream and not asked_to_stream,
        sample_rate=body.sample_rate,
    )


def synthesize_request(
    body: dict[str, Any], settings: Settings, voices: Voices | None = None
) -> tuple[SynthesisRequest, Output]:
    """POST /synthesize: WAV unless asked otherwise."""
    parsed = cast(SynthesizeFields, parse(speech_bodies(settings).synthesize, body))
    return _speech(parsed, parsed.text, "text", voices, settings, default_stream=False)


def speech_request(
    body: dict[str, Any], settings: Settings, voices: Voices | None
) -> tuple[SynthesisRequest, Output]:
    """POST /v1/audio/speech: OpenAI's fields (MP3 by default, streamed unless
    ``"stream": false`` or FLAC, as OpenAI's endpoint answers), plus this service's options."""
    parsed = cast(OpenAISpeechFields, parse(speech_bodies(settings).speech, body))
    return _speech(parsed, parsed.input, "input", voices, settings, default_stream=True)


def captioned_speech_request(
    body: dict[str, Any], settings: Settings, voices: Voices | None
) -> tuple[SynthesisRequest, Output]:
    """POST /v1/audio/captioned_speech: the /v1/audio/speech body plus ``caption_format``;
    answered whole, every sentence read as its own segment so the captions are exact."""
    parsed = cast(CaptionedSpeechFields, parse(speech_bodies(settings).captioned, body))
    request, output = _speech(parsed, parsed.input, "input", voices, settings, default_stream=False)
    return (
        request.each_span(sentence_segments=True),
        Output(
            format=output.format,
            stream=False,
            captions=parsed.caption_format,
            priority=output.priority,
            sample_rate=output.sample_rate,
        ),
    )
