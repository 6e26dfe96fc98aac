"""The playground page (``GET /``) and the small status document it polls (``GET /status``)."""

from __future__ import annotations

from importlib import resources

from flask import Blueprint, Response, jsonify

from chattts_service.api.context import api_keys, service
from chattts_service.api.openapi import operation

blueprint = Blueprint("playground", __name__)


@blueprint.get("/")
@operation("The playground page (HTML, no external assets)", described="HTML")
def page() -> Response:
    html = resources.files("chattts_service.api").joinpath("static/index.html").read_bytes()
    response = Response(html, content_type="text/html; charset=utf-8")
    response.headers["Cache-Control"] = "no-cache"
    return response


@blueprint.get("/status")
@operation(
    "Service status for the playground: state, queue, cache, recent latency and real-time "
    "factor, degraded mode, model, uptime",
    described="Status object",
    errors=(401,),
)
def status() -> Response:
    """What the operators see, as one small JSON object (not Prometheus text)."""
    return jsonify({**service().status(), "auth_required": api_keys().enabled})
