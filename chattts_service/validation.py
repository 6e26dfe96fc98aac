"""Turn an HTTP request body into a SynthesisRequest, or a clear 4xx."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from .config import Settings
from .engine import SynthesisRequest
from .errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

SYNTHESIZE_FIELDS = {"text", "seed", "refine_text"}
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


def synthesize_request(body: dict[str, Any], settings: Settings) -> SynthesisRequest:
    unknown = sorted(set(body) - SYNTHESIZE_FIELDS)
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(unknown)}; accepted: "
                         f"{', '.join(sorted(SYNTHESIZE_FIELDS))}")

    if "text" not in body:
        raise BadRequest("'text' is required")
    text = body["text"]
    if not isinstance(text, str):
        raise BadRequest("'text' must be a string")
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        raise BadRequest("'text' contains an unpaired UTF-16 surrogate")
    text = normalise_text(text)
    if not text:
        raise BadRequest("'text' must not be empty")
    if len(text) > settings.max_chars:
        raise PayloadTooLarge(f"'text' has {len(text)} characters; the limit is {settings.max_chars}")

    seed = body.get("seed", None)
    if seed is None:
        seed = settings.default_seed
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise BadRequest("'seed' must be an integer")
    elif not 0 <= seed <= MAX_SEED:
        raise BadRequest(f"'seed' must be between 0 and {MAX_SEED}")

    refine_text = body.get("refine_text", None)
    if refine_text is None:
        refine_text = settings.refine_text
    elif not isinstance(refine_text, bool):
        raise BadRequest("'refine_text' must be true or false")

    return SynthesisRequest(text=text, seed=seed, refine_text=refine_text)
