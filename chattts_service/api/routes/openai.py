"""The OpenAI-compatible API: /v1/audio/speech (and its captioned form), /v1/models (voices and
consents: ``voices.py``).

Errors on these paths come in OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``; see ``errors.py``), so OpenAI clients raise their usual exceptions.
"""

from __future__ import annotations

from flask import Blueprint, jsonify

from chattts_service.api import validation
from chattts_service.api.errors import NotFound
from chattts_service.api.speech import speak

blueprint = Blueprint("openai", __name__)
CREATED = 1_700_000_000  # a fixed "created" time for the model listing


@blueprint.post("/v1/audio/speech")
def speech():
    return speak(validation.speech_request)


@blueprint.post("/v1/audio/captioned_speech")
def captioned_speech():
    return speak(validation.captioned_speech_request)


@blueprint.get("/v1/models")
def models():
    return jsonify(object="list", data=[_model(name) for name in validation.MODEL_IDS])


@blueprint.get("/v1/models/<name>")
def model(name: str):
    if name not in validation.MODEL_IDS:
        raise NotFound(f"no model {name!r}; models: {', '.join(validation.MODEL_IDS)}")
    return jsonify(_model(name))


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": CREATED, "owned_by": "chattts-service"}
