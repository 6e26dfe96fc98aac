"""What a handler may reach, typed: the running service (its services and lifecycle) and the
API keys. Handlers ask these accessors, never ``current_app.extensions``."""

from __future__ import annotations

from typing import cast

from flask import Flask, current_app

from chattts_service.api.auth import ApiKeys
from chattts_service.services.service import Service

_SERVICE = "chattts.service"
_API_KEYS = "chattts.api_keys"


def install(app: Flask, service: Service, api_keys: ApiKeys) -> None:
    app.extensions[_SERVICE] = service
    app.extensions[_API_KEYS] = api_keys


def service() -> Service:
    """The running service of the app handling this request."""
    return cast(Service, current_app.extensions[_SERVICE])


def api_keys() -> ApiKeys:
    return cast(ApiKeys, current_app.extensions[_API_KEYS])


def service_of(app: object) -> Service | None:
    """The running service of ``app`` outside a request (the server's drain, tests); None
    when ``app`` is not this service's application."""
    service = getattr(app, "extensions", {}).get(_SERVICE)
    return service if isinstance(service, Service) else None
