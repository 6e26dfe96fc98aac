"""Typed errors and the one place that turns them into JSON HTTP responses.

Handlers raise ``ApiError``s for what only HTTP knows (a missing form field, a wrong content
type) and let the services' and the domain's errors through: the tables below map each to its
status, and ``register_error_handlers`` registers them once for every route.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from chattts_service.domain.speech import (
    Cancelled,
    DeadlineExceeded,
    EngineError,
    NothingToSay,
    Overloaded,
    TooManySegments,
)
from chattts_service.domain.voices import (
    NotAnEmbedding,
    TooManyVoices,
    UnknownVoice,
    UnusableBlend,
    VoiceError,
    VoiceExists,
)
from chattts_service.services.admin import TuningRejected
from chattts_service.services.consents import ConsentError, TooManyConsents, UnknownConsent
from chattts_service.services.recordings import RecordingError, WrongContentType
from chattts_service.services.voices import NotLoaded

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 400

    def __init__(
        self,
        message: str,
        status: int | None = None,
        headers: dict[str, Any] | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.headers = headers or {}
        self.param = param  # the field at fault, for OpenAI's error object


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    status = 404


class Conflict(ApiError):
    status = 409


class PayloadTooLarge(ApiError):
    status = 413


class UnsupportedMediaType(ApiError):
    status = 415


class Unprocessable(ApiError):
    status = 422


class NotReady(ApiError):
    """Not now: always with ``Retry-After`` (``RETRY_AFTER_SECONDS`` unless the engine's
    estimate says otherwise)."""

    status = 503

    def __init__(self, message: str, retry_after: str | None = None):
        super().__init__(message, headers={"Retry-After": retry_after or RETRY_AFTER_SECONDS})


class GatewayTimeout(ApiError):
    status = 504


class ClientClosedRequest(ApiError):
    status = 499  # nobody reads it; it marks the request in logs and metrics


class InternalError(ApiError):
    status = 500


# The one table from the engine's errors to HTTP: the error class answered and how its message
# reads. The first row whose type matches wins, so subclasses come before their bases.
ENGINE_ERRORS: list[tuple[type[EngineError], type[ApiError], str]] = [
    (NothingToSay, Unprocessable, "{error}"),
    (TooManySegments, Unprocessable, "{error}"),
    (Overloaded, NotReady, "server is overloaded: {error}"),
    (DeadlineExceeded, GatewayTimeout, "synthesis dropped: {error}"),
    (Cancelled, ClientClosedRequest, "synthesis dropped: {error}"),
    (EngineError, InternalError, "synthesis failed: {error}"),
]
# The voice store's errors: a missing voice, a name taken, a string that is not an embedding;
# any other is a malformed request. A voice missing from a voice's own route is a 404; named in
# a request's field (a speech request's voice, the voice a registration copies) it is a 400.
VOICE_ERRORS: list[tuple[type[VoiceError], type[ApiError], type[ApiError]]] = [
    # the error, on the voice's own route, named in a request's field
    (UnknownVoice, NotFound, BadRequest),
    (VoiceExists, Conflict, Conflict),
    (TooManyVoices, Conflict, Conflict),
    (NotAnEmbedding, Unprocessable, Unprocessable),
    (UnusableBlend, Unprocessable, Unprocessable),
    (VoiceError, BadRequest, BadRequest),
]
# The consent store's errors: a consent that is not there, the bound reached; any other is a
# malformed request.
CONSENT_ERRORS: list[tuple[type[ConsentError], type[ApiError]]] = [
    (UnknownConsent, NotFound),
    (TooManyConsents, Conflict),
    (ConsentError, BadRequest),
]
# The other services' errors: an upload that is not audio of a kind read here, a recording
# that is not usable speech, a tuning out of bounds, a model not loaded yet.
SERVICE_ERRORS: list[tuple[type[Exception], type[ApiError]]] = [
    (WrongContentType, UnsupportedMediaType),
    (RecordingError, Unprocessable),
    (TuningRejected, BadRequest),
]
RETRY_AFTER_SECONDS = "5"  # what a client told "not ready yet" should wait
RETRY_AFTER_BOUNDS = (1, 300)  # seconds an overloaded answer's Retry-After may say


def from_voice_error(error: VoiceError) -> ApiError:
    """The HTTP error for a voice store's error (see ``VOICE_ERRORS``): as the field that named
    the voice has it (``error.field``), else as the voice's own route."""
    for kind, on_route, as_field in VOICE_ERRORS:
        if isinstance(error, kind):
            if error.field is None:
                return on_route(str(error))
            return as_field(str(error), param=error.field)
    raise TypeError(f"not a voice error: {error!r}")


def from_consent_error(error: ConsentError) -> ApiError:
    """The HTTP error for a consent store's error (see ``CONSENT_ERRORS``)."""
    return next(api(str(error)) for kind, api in CONSENT_ERRORS if isinstance(error, kind))


def from_engine_error(error: EngineError) -> ApiError:
    """The HTTP error a client gets for an engine error (see ``ENGINE_ERRORS``)."""
    for kind, api_error, message in ENGINE_ERRORS:
        if isinstance(error, kind):
            text = message.format(error=error)
            if isinstance(error, Overloaded):
                low, high = RETRY_AFTER_BOUNDS
                return NotReady(text, str(max(low, min(high, math.ceil(error.retry_after)))))
            return api_error(text)
    raise TypeError(f"not an engine error: {error!r}")


# every error a service or the domain raises that has a status
DOMAIN_ERRORS: tuple[type[Exception], ...] = (
    EngineError,
    VoiceError,
    ConsentError,
    NotLoaded,
    *(kind for kind, _ in SERVICE_ERRORS),
)


def from_domain_error(error: Exception) -> ApiError:
    """The HTTP error for any of ``DOMAIN_ERRORS``, through its table."""
    if isinstance(error, EngineError):
        return from_engine_error(error)
    if isinstance(error, VoiceError):
        return from_voice_error(error)
    if isinstance(error, ConsentError):
        return from_consent_error(error)
    if isinstance(error, NotLoaded):
        return NotReady(str(error))
    for kind, api_error in SERVICE_ERRORS:
        if isinstance(error, kind):
            return api_error(str(error))
    raise TypeError(f"not a domain error: {error!r}")


def status_of(error: BaseException) -> int:
    """The status a request that raised ``error`` is answered with."""
    if isinstance(error, ApiError):
        return error.status
    if isinstance(error, Exception) and isinstance(error, DOMAIN_ERRORS):
        return from_domain_error(error).status
    if isinstance(error, HTTPException):
        return error.code or 500
    return 500


# OpenAI's error object by status: its ``type`` and its ``code`` (a string, as the official
# clients' ErrorObject types it; the status itself is on the response)
OPENAI_ERRORS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("timeout", "request_timeout"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    414: ("invalid_request_error", "request_line_too_long"),
    415: ("invalid_request_error", "unsupported_media_type"),
    422: ("invalid_request_error", "unprocessable"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    431: ("invalid_request_error", "headers_too_large"),
    503: ("server_busy", "server_busy"),
    504: ("timeout", "timeout"),
}


def error_body(message: str, status: int, path: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": "..."}``, or OpenAI's error object on the /v1/ paths."""
    if path.startswith("/v1/"):
        return {
            "error": {
                "message": message,
                "type": OPENAI_ERRORS.get(status, ("server_error",))[0],
                "param": param,
                "code": OPENAI_ERRORS.get(status, (None, "server_error"))[1],
            }
        }
    return {"error": message}


def error_response(
    message: str, status: int, headers: dict[str, Any] | None = None, param: str | None = None
) -> Response:
    response = jsonify(error_body(message, status, request.path, param))
    response.status_code = status
    response.headers.update(headers or {})
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def handle_api_error(error: ApiError) -> Response:
        return error_response(error.message, error.status, error.headers, error.param)

    def handle_domain_error(error: Exception) -> Response:
        api_error = from_domain_error(error)
        return error_response(
            api_error.message, api_error.status, api_error.headers, api_error.param
        )

    for kind in DOMAIN_ERRORS:
        app.register_error_handler(kind, handle_domain_error)

    @app.errorhandler(HTTPException)
    def handle_http_exception(error: HTTPException) -> Response:
        # keep what the exception says in headers (405's Allow, RFC 9110), not its HTML body
        headers = {k: v for k, v in error.get_headers() if k.lower() != "content-type"}
        return error_response(error.description or error.name, error.code or 500, headers)

    @app.errorhandler(Exception)
    def handle_unexpected(error: Exception) -> Response:
        log.exception("unhandled error")
        return error_response("internal error; the details are in the server log", 500)
