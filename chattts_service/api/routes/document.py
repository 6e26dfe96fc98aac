"""GET /openapi.json: the API described, generated from the routes and their models."""

from __future__ import annotations

import functools
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify

from chattts_service.api.context import service
from chattts_service.api.openapi import Context, document, operation
from chattts_service.config import Bounds, Settings

blueprint = Blueprint("document", __name__)


@blueprint.get("/openapi.json")
@operation("This document", described="OpenAPI 3.1")
def openapi_document() -> Response:
    running = service()
    voices = tuple(running.voices.names())  # the defaults until the model loads
    limits = tuple(running.admin.limits().items())
    app = current_app._get_current_object()  # type: ignore[attr-defined]  # the proxy's app
    return jsonify(_document(app, running.settings, voices, limits))


@functools.lru_cache(maxsize=4)
def _document(
    app: Flask, settings: Settings, voices: tuple[str, ...], limits: tuple[tuple[str, Bounds], ...]
) -> dict[str, Any]:
    """The same document until the voices (or the limits) change: generating it takes ~10 ms
    of a thread the model's needs too."""
    return document(app, Context(settings, list(voices), dict(limits)))
