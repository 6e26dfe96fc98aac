"""Liveness, readiness and metrics: what orchestrators and Prometheus call."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from chattts_service.api.answers import Alive, Ready
from chattts_service.api.context import service
from chattts_service.api.errors import RETRY_AFTER_SECONDS
from chattts_service.api.openapi import operation

blueprint = Blueprint("health", __name__)


@blueprint.get("/healthz")
@operation("Liveness", answer=Alive, described="Alive")
def healthz() -> Response:
    return jsonify(status="alive")


@blueprint.get("/readyz")
@operation(
    "Readiness: 200 once loaded and warmed up",
    answer=Ready,
    described="Ready",
    others={503: (Ready, "Not ready: the phase (and the download's progress); Retry-After")},
)
def readyz() -> Response:
    state = service()
    phase = state.serving_phase  # read once: the answer and its body agree
    if phase == "ready":
        return jsonify(status="ready", model=state.model_name)
    body = {"status": phase, "phase": phase}
    if phase == "downloading":
        body.update(state.download.snapshot())
    if state.failure:
        body["error"] = state.failure
    response = jsonify(body)
    response.status_code = 503
    response.headers["Retry-After"] = RETRY_AFTER_SECONDS
    return response


@blueprint.get("/metrics")
@operation("Prometheus metrics", described="Prometheus text format", errors=(401,))
def metrics() -> Response:
    state = service()
    state.metrics.cache_entries.set(len(state.cache))
    state.metrics.cache_bytes.set(state.cache.bytes)
    return Response(state.metrics.render(), mimetype="text/plain; version=0.0.4")
