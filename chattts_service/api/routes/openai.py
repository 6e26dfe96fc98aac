"""The OpenAI-compatible API: /v1/audio/speech (and its captioned form), /v1/models (voices and
consents: ``voices.py``).

Errors on these paths come in OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``; see ``errors.py``), so OpenAI clients raise their usual exceptions.
"""

from __future__ import annotations

from typing import Literal

from flask import Blueprint, Response, jsonify

from chattts_service.api import validation
from chattts_service.api.answers import CaptionedSpeech, Model, ModelList
from chattts_service.api.errors import NotFound
from chattts_service.api.models import MODEL_IDS, speech_bodies
from chattts_service.api.openapi import AUDIO, BODY_ERRORS, operation
from chattts_service.api.speech import speak

blueprint = Blueprint("openai", __name__)
CREATED = 1_700_000_000  # a fixed "created" time for the model listing


@blueprint.post("/v1/audio/speech")
@operation(
    "OpenAI-compatible speech (MP3 by default)",
    body=lambda context: speech_bodies(context.settings).speech,
    answer=AUDIO,
    errors=(*BODY_ERRORS, 422, 503, 504),
)
def speech() -> Response:
    return speak(validation.speech_request)


@blueprint.post("/v1/audio/captioned_speech")
@operation(
    "Speech with a caption per sentence, timed to the sample (JSON: base64 audio, captions, "
    "and SubRip or WebVTT when asked)",
    body=lambda context: speech_bodies(context.settings).captioned,
    answer=CaptionedSpeech,
    described="Audio and captions. Headers as /v1/audio/speech.",
    errors=(*BODY_ERRORS, 422, 503, 504),
)
def captioned_speech() -> Response:
    return speak(validation.captioned_speech_request)


@blueprint.get("/v1/models")
@operation("Model names accepted in 'model'", answer=ModelList, errors=(401,))
def models() -> Response:
    return jsonify(ModelList(data=[_model(name) for name in MODEL_IDS]).model_dump())


@blueprint.get("/v1/models/<name>")
@operation("One model", answer=Model, path={"name": Literal[MODEL_IDS]}, errors=(401, 404))
def model(name: str) -> Response:
    if name not in MODEL_IDS:
        raise NotFound(f"no model {name!r}; models: {', '.join(MODEL_IDS)}")
    return jsonify(_model(name).model_dump())


def _model(name: str) -> Model:
    return Model(id=name, created=CREATED, owned_by="chattts-service")
