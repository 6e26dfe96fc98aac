"""The request bodies' JSON Schemas in the OpenAPI document: /synthesize's and
/v1/audio/speech's shared options, the text's rules, voices (names, ``seed:N``, blends) and the
captioned request. Built from the definitions validation enforces (``api.validation``)."""

from __future__ import annotations

from chattts_service.api.schemas import blend_pattern, seed_voice_pattern, text_patterns
from chattts_service.api.validation import (
    MAX_INSTRUCTIONS_CHARS,
    MODEL_IDS,
    SEED,
    SPEED,
    STREAM_FORMAT_CHOICES,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)
from chattts_service.config import Settings
from chattts_service.domain.text import INLINE_TOKENS
from chattts_service.services.audio import FORMATS, STREAM_FORMATS
from chattts_service.services.captions import CAPTION_FORMATS


def _nullable(kind: str, **schema) -> dict:
    return {"type": [kind, "null"], **schema}


def voice_schema(voices: list[str], required: bool) -> dict:
    names = [
        {"enum": sorted(voices)},
        {"type": "string", "pattern": seed_voice_pattern()},
        {"type": "string", "pattern": blend_pattern(voices)},
    ]
    choices = [
        *names,
        {  # OpenAI's custom-voice reference; any voice's name is its id here
            "type": "object",
            "required": ["id"],
            "additionalProperties": False,
            "properties": {"id": {"anyOf": names}},
        },
    ]
    description = (
        "A named voice (GET /v1/audio/voices), seed:N, or a blend of them such as "
        "alloy(2)+echo(1) (weights normalised; 422 when none is above 0); or any of them as "
        'OpenAI\'s voice object {"id": "..."}.'
    ) + ("" if required else " Without it the voice of 'seed'.")
    if not required:
        choices.append({"type": "null"})
    return {"anyOf": choices, "description": description}


def _options(settings: Settings, voices: list[str], required_voice: bool) -> dict:
    return {
        "voice": voice_schema(voices, required_voice),
        "seed": SEED.schema(settings.default_seed),
        "speed": SPEED.schema(),
        "temperature": TEMPERATURE.schema(),
        "top_p": TOP_P.schema(),
        "top_k": TOP_K.schema(),
        "refine_text": _nullable(
            "boolean",
            default=settings.refine_text,
            description="Let the model rewrite the text first (pauses, fillers, laughter).",
        ),
        "refine_prompt": _nullable(
            "string",
            pattern=r"^( *\[(oral_\d|laugh_[0-2]|break_[0-7])\])* *$",
            description="Control tokens for refinement, e.g. [oral_2][laugh_0][break_6]; "
            "needs refine_text.",
        ),
        "normalize": _nullable(
            "boolean",
            default=settings.normalize,
            description="Write numbers, dates, money, units and phone numbers out in words "
            "(wetext, zh and en) first.",
        ),
        "stream": _nullable(
            "boolean",
            default=False,
            description="Send audio while it is generated (chunked; "
            f"{' or '.join(STREAM_FORMATS)} only).",
        ),
        "stream_format": _nullable(
            "string",
            enum=[*STREAM_FORMAT_CHOICES, None],
            default="audio",
            description="OpenAI's: 'audio' (the audio itself) or 'sse' (Server-Sent Events: "
            "speech.audio.delta with base64 audio as it is generated, then "
            "speech.audio.done; for flac one delta holds the whole file).",
        ),
    }


def _text(settings: Settings) -> dict:
    whole, somewhere = text_patterns()
    return {
        "type": "string",
        "minLength": 1,
        "maxLength": settings.max_chars,
        "pattern": whole,
        "allOf": [{"pattern": somewhere}],
        "description": "Chinese and/or English, up to maxLength code points. Inline control "
        f"tokens allowed: {', '.join(INLINE_TOKENS)} (at most {settings.max_control_tokens}). "
        "Long text is split at sentence boundaries.",
    }


def speech_request(settings, voices, text_field, format_field, default_format, openai):
    """/synthesize's and /v1/audio/speech's body: the same options, two spellings."""
    properties = {
        text_field: _text(settings),
        format_field: _nullable("string", enum=[*FORMATS, None], default=default_format),
        **_options(settings, voices, required_voice=openai),
    }
    required = [text_field]
    if openai:
        properties["model"] = {"type": "string", "enum": list(MODEL_IDS)}
        properties["instructions"] = _nullable(
            "string",
            maxLength=0 if settings.instructions == "refuse" else MAX_INSTRUCTIONS_CHARS,
            description="OpenAI's voice instructions. ChatTTS cannot follow free text: the text "
            "is spoken as it would be without them and the answer says X-Instructions: ignored"
            + (
                " (refused here: CHATTTS_INSTRUCTIONS=refuse)."
                if settings.instructions == "refuse"
                else "."
            ),
        )
        properties["stream"] = _nullable(
            "boolean",
            default=True,
            description="As OpenAI's endpoint: audio is sent while it is generated (chunked) "
            f"in {', '.join(STREAM_FORMATS)}; flac comes whole. false asks for the whole file "
            "with a Content-Length.",
        )
        required = ["model", text_field, "voice"]
    stream_then = {"properties": {format_field: {"enum": list(STREAM_FORMATS)}}}
    if default_format not in STREAM_FORMATS:
        stream_then["required"] = [format_field]
    refine_then = (
        {"properties": {"refine_text": {"enum": [True, None]}}}
        if settings.refine_text
        else {"properties": {"refine_text": {"const": True}}, "required": ["refine_text"]}
    )
    return {
        "type": "object",
        "additionalProperties": False,
        "required": required,
        "properties": properties,
        "allOf": [
            {  # a stream sends wav or pcm
                "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
                "then": stream_then,
            },
            {  # a refinement prompt needs refinement
                "if": {
                    "properties": {"refine_prompt": {"type": "string", "pattern": r"\["}},
                    "required": ["refine_prompt"],
                },
                "then": refine_then,
            },
        ],
    }


def captioned_request(settings, voices) -> dict:
    """/v1/audio/speech's body plus ``caption_format``; answered whole, so no streaming."""
    schema = speech_request(settings, voices, "input", "response_format", "mp3", openai=True)
    properties = schema["properties"]
    properties["caption_format"] = _nullable(
        "string",
        enum=[*CAPTION_FORMATS, None],
        default="json",
        description="json: captions in the JSON answer only; srt or vtt: also as a SubRip or "
        "WebVTT string.",
    )
    properties["stream"] = _nullable("boolean", enum=[False, None], default=False)
    properties["stream_format"] = _nullable("string", enum=["audio", None], default="audio")
    return schema
