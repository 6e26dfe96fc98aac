"""The JSON Schema pieces the OpenAPI document is built from where a field's rule is more than
a type and bounds: voice names, ``seed:N``, blends, the text's control tokens, the speech
events, the captioned answer.

Each states a rule the service enforces in code (domain/voices.py, domain/text.py,
api/validation.py); tests/test_contract.py holds the two to each other.
"""

from __future__ import annotations

import re

from chattts_service.config import MAX_SEED
from chattts_service.domain.text import INLINE_TOKENS
from chattts_service.domain.voices import MAX_BLEND_PARTS, NAME
from chattts_service.services.audio import FORMATS

VOICE_NAME = NAME.pattern
BLEND_WEIGHT = r"(?:\d{1,4}(?:\.\d{1,6})?|\.\d{1,6})"  # 0-9999.999999, as domain/voices.py


def seed_voice_pattern(maximum: int = MAX_SEED) -> str:
    """``seed:N`` for N from 0 to ``maximum`` (leading zeros allowed, as int() takes them)."""
    return rf"^{_seed_voice(maximum)}$"


def blend_pattern(voices: list[str]) -> str:
    """``name(weight)+name(weight)``, each part one of ``voices`` or ``seed:N``, the weight
    optional. (That the weights add up to more than 0 is checked by the service: 422.)"""
    names = "|".join(re.escape(name) for name in sorted(voices, key=lambda n: (-len(n), n)))
    voice = f"(?:{names}|{_seed_voice(MAX_SEED)})" if names else _seed_voice(MAX_SEED)
    part = rf"{voice}(?:\({BLEND_WEIGHT}\))?"
    return rf"^{part}(?:\+{part}){{0,{MAX_BLEND_PARTS - 1}}}$"


def _seed_voice(maximum: int) -> str:
    digits = str(maximum)
    alternatives = [rf"\d{{1,{len(digits) - 1}}}"]
    for index, digit in enumerate(digits):
        rest = len(digits) - index - 1
        if index == len(digits) - 1:
            alternatives.append(digits[:index] + f"[0-{digit}]")
        elif digit != "0":
            low = "0" if index else "1"
            if int(digit) - 1 >= int(low):
                alternatives.append(digits[:index] + f"[{low}-{int(digit) - 1}]" + rf"\d{{{rest}}}")
    return r"seed:0*(?:" + "|".join(alternatives) + r")"


def text_patterns() -> tuple[str, str]:
    """What the service takes as text, as two plain patterns: the whole text holds no
    ``[...]`` but the inline control tokens (a "[" counts as a token's start when a "]" comes
    before the next "["); and somewhere it has something besides white space and control
    characters. (Unpaired UTF-16 surrogates are refused too; JSON Schema cannot say so.)"""
    tokens = "|".join(token.strip("[]") for token in INLINE_TOKENS)
    segment = rf"\[(?:(?:{tokens})\][^\[]*|[^\[\]]*)"
    visible = rf"[^\s\x00-\x1f\x7f-\x9f\[]|\[(?:{tokens})\]"
    return rf"^[^\[]*(?:{segment})*$", visible


SPEECH_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["type", "audio"],
                        "properties": {
                            "type": {"const": "speech.audio.delta"},
                            "audio": {"type": "string", "contentEncoding": "base64"},
                        },
                    },
                    {
                        "type": "object",
                        "required": ["type", "usage"],
                        "properties": {
                            "type": {"const": "speech.audio.done"},
                            "usage": {"type": "object"},
                        },
                    },
                ]
            },
        },
    },
}

CAPTION = {
    "type": "object",
    "required": ["start", "end", "text", "spoken_text", "start_sample", "end_sample"],
    "properties": {
        "start": {"type": "number", "description": "seconds into the audio"},
        "end": {"type": "number"},
        "text": {"type": "string", "description": "the sentence as sent"},
        "spoken_text": {"type": "string", "description": "as the model read it (normalised)"},
        "start_sample": {"type": "integer", "description": "24 kHz samples: exact"},
        "end_sample": {"type": "integer"},
    },
}
CAPTIONED_SPEECH = {
    "type": "object",
    "required": ["audio", "format", "content_type", "seconds", "captions"],
    "properties": {
        "audio": {"type": "string", "contentEncoding": "base64"},
        "format": {"type": "string", "enum": list(FORMATS)},
        "content_type": {"type": "string"},
        "seconds": {"type": "number"},
        "captions": {"type": "array", "items": CAPTION},
        "srt": {"type": "string"},
        "vtt": {"type": "string"},
    },
}
