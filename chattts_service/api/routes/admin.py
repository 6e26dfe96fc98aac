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
from chattts_service.api.models import Tuning, tuning_body
from chattts_service.api.openapi import BODY_ERRORS, operation
from chattts_service.inference.fairness import ORDER
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


def _body(limits: dict):
    """The request model for these limits (one per set of bounds)."""
    return tuning_body(tuple((name, bounds.low, bounds.high) for name, bounds in limits.items()))


@blueprint.get("/admin/config")
@operation(
    "Batching settings in effect, and their limits (API key)",
    answer=Tuning,
    errors=(401, 403, 503),
)
def show():
    policy = _policy()
    limits = {
        name: {"min": bounds.low, "max": bounds.high} for name, bounds in policy.limits().items()
    }
    return jsonify(
        Tuning(current=policy.snapshot(), limits=limits, scheduling=list(ORDER)).model_dump()
    )


@blueprint.post("/admin/config")
@operation(
    "Change the batching and sharing knobs on the running server (API key)",
    body=lambda context: _body(context.limits),
    answer=Tuning,
    described="Settings now in effect",
    errors=(*BODY_ERRORS, 403, 503),
)
def change():
    policy = _policy()
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    changes = validation.parse(_body(policy.limits()), body).model_dump(exclude_none=True)
    if not changes:
        raise BadRequest(f"send one or more of {', '.join(policy.limits())}")
    try:
        current = current_app.extensions["chattts"].engine.tune(**changes)
    except PolicyError as error:
        raise BadRequest(str(error)) from None
    log.warning("batching tuned at run time: %s", changes)
    return jsonify(Tuning(current=current).model_dump(exclude_none=True))
