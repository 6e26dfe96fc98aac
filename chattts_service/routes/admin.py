"""Tune batching on a running server: ``GET``/``POST /admin/config``.

Only with API keys configured (the endpoint refuses to exist unauthenticated), bounded to safe
ranges, logged, and visible in ``chatts_config{setting}``. Changes last until the process
restarts; put them in the environment to keep them.
"""

from __future__ import annotations

import logging

from flask import Blueprint, current_app, jsonify, request

from .. import validation
from ..errors import ApiError, BadRequest

blueprint = Blueprint("admin", __name__)
log = logging.getLogger(__name__)


def limits(state) -> dict[str, tuple[float, float]]:
    return {
        "max_batch": (1, state.settings.max_batch),  # never above the rows the heads were built for
        "batch_wait_ms": (0, 2000),
        "max_queue": (1, 4096),
        "max_wait_s": (0, 3600),
    }


def current(state) -> dict:
    scheduler = state.engine.scheduler
    return {
        "max_batch": scheduler.max_batch,
        "batch_wait_ms": round(scheduler.batch_wait * 1000),
        "max_queue": scheduler.queue.maxsize,
        "max_wait_s": state.engine.max_wait_s,
    }


def _state():
    state = current_app.extensions["chattts"]
    if not state.api_keys.enabled:
        raise ApiError("the admin endpoint needs API keys (CHATTTS_API_KEYS); none are set",
                       status=403)
    if state.engine.scheduler is None or state.engine.scheduler.batch is None:
        raise ApiError(f"model is not ready ({state.phase})", status=503)
    return state


@blueprint.get("/admin/config")
def show():
    state = _state()
    return jsonify(current=current(state),
                   limits={k: {"min": lo, "max": hi} for k, (lo, hi) in limits(state).items()})


@blueprint.post("/admin/config")
def change():
    state = _state()
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    bounds = limits(state)
    unknown = sorted(set(body) - set(bounds))
    if unknown or not body:
        raise BadRequest(f"send one or more of {', '.join(bounds)}"
                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    values = {}
    for name, (low, high) in bounds.items():
        if name in body:
            value = body[name]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise BadRequest(f"'{name}' must be an integer from {low} to {high}")
            values[name] = value
    state.engine.scheduler.tune(
        max_batch=values.get("max_batch"),
        batch_wait_seconds=values["batch_wait_ms"] / 1000 if "batch_wait_ms" in values else None,
        max_queue=values.get("max_queue"))
    if "max_wait_s" in values:
        state.engine.max_wait_s = values["max_wait_s"]
    log.warning("batching tuned at run time: %s", values)
    return jsonify(current=current(state))
