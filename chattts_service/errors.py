"""Typed errors and the one place that turns them into JSON HTTP responses."""

from __future__ import annotations

import logging

from flask import Flask, jsonify
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


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def handle_api_error(error: ApiError):
        response = jsonify(error=error.message)
        response.status_code = error.status
        response.headers.update(error.headers)
        return response

    @app.errorhandler(HTTPException)
    def handle_http_exception(error: HTTPException):
        response = jsonify(error=error.description or error.name)
        response.status_code = error.code or 500
        return response

    @app.errorhandler(Exception)
    def handle_unexpected(error: Exception):
        log.exception("unhandled error")
        response = jsonify(error="internal error; the details are in the server log")
        response.status_code = 500
        return response
