"""The OpenAI-compatible API: /v1/audio/speech (and its captioned form), /v1/models, voices.

Errors on these paths come in OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``; see ``errors.py``), so OpenAI clients raise their usual exceptions.
"""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify, request

from chattts_service.api import validation
from chattts_service.api.errors import (
    RETRY_AFTER_SECONDS,
    BadRequest,
    NotFound,
    NotReady,
    from_voice_error,
)
from chattts_service.api.speech import speak
from chattts_service.services.voices import UnknownVoice, VoiceError

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


def _voices():
    state = current_app.extensions["chattts"]
    if state.engine.voices is None:
        raise NotReady(
            f"model is not ready ({state.phase})", headers={"Retry-After": RETRY_AFTER_SECONDS}
        )
    return state.engine.voices


@blueprint.get("/v1/audio/voices")
def list_voices():
    listing = _voices().listing()
    return jsonify(
        voices=[item["name"] for item in listing],
        details=listing,
        seed_voices="seed:N (N from 0 to 2147483647)",
    )


@blueprint.post("/v1/audio/voices")
def register_voice():
    """Register a named voice from a ChatTTS speaker embedding string, or from a voice this
    server resolves (a blend such as ``alloy(2)+echo(1)``, ``seed:N``)."""
    store = _voices()
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    unknown = sorted(set(body) - {"name", "embedding", "voice", "replace"})
    if unknown:
        raise BadRequest(
            f"unknown fields: {', '.join(unknown)}; accepted: embedding, name, replace, voice"
        )
    replace = body.get("replace", False)
    if not isinstance(replace, bool):
        raise BadRequest("'replace' must be true or false")
    source = validation.voice_reference(body.get("voice"))
    if source is not None and not isinstance(source, str):
        raise BadRequest("'voice' must be a string")
    try:
        voice = store.register(
            body.get("name"), body.get("embedding"), replace=replace, voice=source
        )
    except UnknownVoice as error:  # the voice to store does not exist: as in a speech request
        raise BadRequest(str(error)) from None
    except VoiceError as error:
        raise from_voice_error(error) from None
    response = jsonify(voice.describe())
    response.status_code = 201
    return response


@blueprint.delete("/v1/audio/voices/<name>")
def delete_voice(name: str):
    try:
        _voices().delete(name)
    except VoiceError as error:
        raise from_voice_error(error) from None
    return jsonify(deleted=name)
