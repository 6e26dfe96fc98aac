"""Tune batching on a running server: ``GET``/``POST /admin/config``.

Only with API keys configured (the endpoint refuses to exist unauthenticated), bounded to the
ranges the batching policy declares, logged, and visible in ``chatts_config{setting}``. Changes
last until the process restarts; put them in the environment to keep them.
"""

from __future__ import annotations

import logging

from flask import Blueprint, current_app, jsonify, request

from chattts_service.api import validation
from chattts_service.api.errors import BadRequest, Forbidden, NotReady
from chattts_service.inference.policy import PolicyError

blueprint = Blueprint("admin", __name__)
log = logging.getLogger(__name__)


def _policy():
    state = current_app.extensions["chattts"]
    if not state.api_keys.enabled:
        raise Forbidden("the admin endpoint needs API keys (CHATTTS_API_KEYS); none are set")
    if not state.engine.loaded:
        raise NotReady(f"model is not ready ({state.phase})")
    return state.engine.policy


@blueprint.get("/admin/config")
def show():
    policy = _policy()
    return jsonify(
        current=policy.snapshot(),
        limits={
            name: {"min": bounds.low, "max": bounds.high}
            for name, bounds in policy.limits().items()
        },
    )


@blueprint.post("/admin/config")
def change():
    policy = _policy()
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    if not body:
        raise BadRequest(f"send one or more of {', '.join(policy.limits())}")
    try:
        changes = {name: validation.integral(value) for name, value in body.items()}
        current = current_app.extensions["chattts"].engine.tune(**changes)
    except PolicyError as error:
        raise BadRequest(str(error)) from None
    log.warning("batching tuned at run time: %s", body)
    return jsonify(current=current)
