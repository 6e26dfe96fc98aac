"""GET /openapi.json: the API described, generated from the routes and their models."""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify

from chattts_service.api.openapi import Context, document, operation
from chattts_service.domain.voices import DEFAULT_VOICES

blueprint = Blueprint("document", __name__)


@blueprint.get("/openapi.json")
@operation("This document", described="OpenAPI 3.1")
def openapi_document():
    state = current_app.extensions["chattts"]
    engine = state.engine
    # the voices a request may name now: the defaults until the model (and its store) loads
    voices = engine.voices.names() if engine.voices is not None else list(DEFAULT_VOICES)
    context = Context(state.settings, voices, engine.policy.limits())
    return jsonify(document(current_app, context))
