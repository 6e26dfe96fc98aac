"""Liveness, readiness and metrics: what orchestrators and Prometheus call."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify

from chattts_service.api.errors import RETRY_AFTER_SECONDS

blueprint = Blueprint("health", __name__)


@blueprint.get("/healthz")
def healthz():
    return jsonify(status="alive")


@blueprint.get("/readyz")
def readyz():
    state = current_app.extensions["chattts"]
    if state.ready:
        return jsonify(status="ready", model=state.engine.model_name)
    body = {"status": state.phase, "phase": state.phase}
    if state.phase == "downloading":
        body.update(state.download.snapshot())
    if state.failure:
        body["error"] = state.failure
    response = jsonify(body)
    response.status_code = 503
    response.headers["Retry-After"] = RETRY_AFTER_SECONDS
    return response


@blueprint.get("/metrics")
def metrics():
    state = current_app.extensions["chattts"]
    state.metrics.cache_entries.set(len(state.cache))
    state.metrics.cache_bytes.set(state.cache.bytes)
    return Response(state.metrics.render(), mimetype="text/plain; version=0.0.4")
