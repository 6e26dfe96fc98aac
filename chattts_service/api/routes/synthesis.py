"""POST /synthesize: this service's own speech endpoint (WAV by default)."""

from __future__ import annotations

from flask import Blueprint, Response

from chattts_service.api import validation
from chattts_service.api.models import speech_bodies
from chattts_service.api.openapi import AUDIO, BODY_ERRORS, operation
from chattts_service.api.speech import speak

blueprint = Blueprint("synthesis", __name__)


@blueprint.post("/synthesize")
@operation(
    "Synthesise speech (WAV by default)",
    body=lambda context: speech_bodies(context.settings).synthesize,
    answer=AUDIO,
    errors=(*BODY_ERRORS, 422, 503, 504),
)
def synthesize() -> Response:
    return speak(validation.synthesize_request)
