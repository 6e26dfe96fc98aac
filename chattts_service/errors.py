"""Typed errors and the one place that turns them into JSON HTTP responses."""

from __future__ import annotations

import logging

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 400

    def __init__(self, message: str, status: int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.headers = headers or {}


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class NotFound(ApiError):
    status = 404


class PayloadTooLarge(ApiError):
    status = 413


class UnsupportedMediaType(ApiError):
    status = 415


class Unprocessable(ApiError):
    status = 422


class NotReady(ApiError):
    status = 503


class GatewayTimeout(ApiError):
    status = 504


class ClientClosedRequest(ApiError):
    status = 499  # nobody reads it; it marks the request in logs and metrics


OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                      404: "not_found_error", 413: "invalid_request_error",
                      415: "invalid_request_error", 422: "invalid_request_error",
                      429: "rate_limit_error", 503: "server_busy", 504: "timeout"}


def error_response(message: str, status: int, headers: dict | None = None):
    """``{"error": "..."}``, or OpenAI's error object on the /v1/ paths."""
    if request.path.startswith("/v1/"):
        response = jsonify(error={"message": message,
                                  "type": OPENAI_ERROR_TYPES.get(status, "server_error"),
                                  "param": None, "code": status})
    else:
        response = jsonify(error=message)
    response.status_code = status
    response.headers.update(headers or {})
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def handle_api_error(error: ApiError):
        return error_response(error.message, error.status, error.headers)

    @app.errorhandler(HTTPException)
    def handle_http_exception(error: HTTPException):
        return error_response(error.description or error.name, error.code or 500)

    @app.errorhandler(Exception)
    def handle_unexpected(error: Exception):
        log.exception("unhandled error")
        return error_response("internal error; the details are in the server log", 500)
