"""GET /openapi.json: the API described, generated from the routes and their models."""

from __future__ import annotations

import functools

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
    limits = tuple(engine.policy.limits().items())
    return jsonify(
        _document(current_app._get_current_object(), state.settings, tuple(voices), limits)
    )


@functools.lru_cache(maxsize=4)
def _document(app, settings, voices: tuple, limits: tuple) -> dict:
    """The same document until the voices (or the limits) change: generating it takes ~10 ms
    of a thread the model's needs too."""
    return document(app, Context(settings, list(voices), dict(limits)))
