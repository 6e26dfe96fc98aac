"""Tune batching on a running server: ``GET``/``POST /admin/config``.

Only with API keys configured (the endpoint refuses to exist unauthenticated), bounded to the
ranges the batching policy declares, logged, and visible in ``chatts_config{setting}``. Changes
last until the process restarts; put them in the environment to keep them.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, request

from chattts_service.api import validation
from chattts_service.api.answers import Tuning
from chattts_service.api.context import api_keys, service
from chattts_service.api.errors import BadRequest, Forbidden
from chattts_service.api.models import Body, tuning_body
from chattts_service.api.openapi import BODY_ERRORS, operation
from chattts_service.services.admin import AdminService

blueprint = Blueprint("admin", __name__)


def _admin() -> AdminService:
    if not api_keys().enabled:
        raise Forbidden("the admin endpoint needs API keys (CHATTTS_API_KEYS); none are set")
    return service().admin


def _body(limits: dict[str, Any]) -> type[Body]:
    """The request model for these limits (one per set of bounds)."""
    return tuning_body(tuple((name, bounds.low, bounds.high) for name, bounds in limits.items()))


@blueprint.get("/admin/config")
@operation(
    "Batching settings in effect, and their limits (API key)",
    answer=Tuning,
    errors=(401, 403, 503),
)
def show() -> Response:
    admin = _admin()
    current = admin.current()
    limits = {
        name: {"min": bounds.low, "max": bounds.high} for name, bounds in admin.limits().items()
    }
    return jsonify(Tuning(current=current, limits=limits, scheduling=admin.order()).model_dump())


@blueprint.post("/admin/config")
@operation(
    "Change the batching and sharing knobs on the running server (API key)",
    body=lambda context: _body(context.limits),
    answer=Tuning,
    described="Settings now in effect",
    errors=(*BODY_ERRORS, 403, 503),
)
def change() -> Response:
    admin = _admin()
    admin.current()  # 503 before the body is read while the model loads
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    changes = validation.parse(_body(admin.limits()), body).model_dump(exclude_none=True)
    if not changes:
        raise BadRequest(f"send one or more of {', '.join(admin.limits())}")
    return jsonify(Tuning(current=admin.tune(changes)).model_dump(exclude_none=True))
