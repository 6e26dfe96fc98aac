"""The JSON Schema pieces the OpenAPI document is built from where a field's rule is more than
a type and bounds: voice names, ``seed:N``, the text's control tokens, the speech events.

Each states a rule the service enforces in code (services/voices.py, services/text.py,
api/validation.py); tests/test_contract.py holds the two to each other.
"""

from __future__ import annotations

from chattts_service.services.text import INLINE_TOKENS
from chattts_service.services.voices import MAX_SEED, NAME

VOICE_NAME = NAME.pattern


def seed_voice_pattern(maximum: int = MAX_SEED) -> str:
    """``seed:N`` for N from 0 to ``maximum`` (leading zeros allowed, as int() takes them)."""
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
    return r"^seed:0*(" + "|".join(alternatives) + r")$"


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
