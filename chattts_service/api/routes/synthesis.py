"""POST /synthesize: this service's own speech endpoint (WAV by default)."""

from __future__ import annotations

from flask import Blueprint

from chattts_service.api import validation
from chattts_service.api.speech import speak

blueprint = Blueprint("synthesis", __name__)


@blueprint.post("/synthesize")
def synthesize():
    return speak(validation.synthesize_request)
