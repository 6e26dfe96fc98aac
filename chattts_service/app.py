"""The Flask application factory: nothing heavy happens at import time."""

from __future__ import annotations

import logging
import time

from flask import Flask, g, jsonify, request

from chattts_service.api.auth import ApiKeys
from chattts_service.api.errors import Unauthorized, from_engine_error, register_error_handlers
from chattts_service.api.openapi import document
from chattts_service.api.routes import admin, health, openai, playground, synthesis
from chattts_service.config import Settings
from chattts_service.inference.engine import Engine
from chattts_service.inference.policy import KNOBS
from chattts_service.runtime.metrics import Metrics
from chattts_service.runtime.pressure import Pressure
from chattts_service.services.cache import AudioCache
from chattts_service.services.speech import SpeechPipeline
from chattts_service.state import ServiceState

log = logging.getLogger("chattts_service.access")

MAX_BODY_BYTES = 64 * 1024


def create_app(
    settings: Settings | None = None,
    *,
    engine: Engine | None = None,
    start_loading: bool = True,
    exit_on_load_failure: bool = False,
) -> Flask:
    settings = settings or Settings.from_env()
    app = Flask(__name__, static_folder="api/static")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.json.ensure_ascii = False

    metrics = Metrics()
    engine = engine or Engine(settings, step_observer=metrics.observe_step)
    state = ServiceState(
        settings=settings,
        engine=engine,
        cache=AudioCache(settings.cache_size, settings.cache_mb * 2**20),
        metrics=metrics,
        api_keys=ApiKeys.from_settings(settings),
        pressure=Pressure(settings.degrade_cpu_percent, settings.degrade_after_s),
    )
    state.speech = SpeechPipeline(
        settings,
        engine,
        state.cache,
        metrics,
        state.recent,
        status_of=lambda error: from_engine_error(error).status,
    )
    app.extensions["chattts"] = state
    metrics.degraded.set_function(lambda: float(state.degraded))
    for name in KNOBS:
        metrics.config.labels(setting=name).set_function(
            lambda name=name: float(engine.policy.snapshot()[name])
        )
    metrics.segments_queued.set_function(lambda: float(engine.scheduler.depth))

    @app.before_request
    def check_api_key():
        needs_key = state.api_keys.enabled and not ApiKeys.is_open(
            request.path, settings.metrics_auth
        )
        if needs_key and not state.api_keys.allows(request.headers.get("Authorization")):
            metrics.auth_failures.inc()
            raise Unauthorized(
                "a valid API key is required: Authorization: Bearer <key>",
                headers={"WWW-Authenticate": "Bearer"},
            )

    register_error_handlers(app)
    app.register_blueprint(health.blueprint)
    app.register_blueprint(synthesis.blueprint)
    app.register_blueprint(openai.blueprint)
    app.register_blueprint(playground.blueprint)
    app.register_blueprint(admin.blueprint)

    @app.get("/openapi.json")
    def openapi_document():
        return jsonify(document(settings))

    @app.before_request
    def remember_start():
        g.started = time.perf_counter()

    @app.after_request
    def log_request(response):
        if g.get("degraded"):
            response.headers["X-Degraded"] = "1"
        duration = time.perf_counter() - g.get("started", time.perf_counter())
        if request.path in ("/healthz", "/readyz", "/metrics"):
            return response  # probes and scrapes would drown the log
        log.info(
            "%s %s %d %.3fs audio=%.2fs cache=%s",
            request.method,
            request.path,
            response.status_code,
            duration,
            g.get("audio_seconds", 0.0),
            g.get("cache", "-"),
        )
        return response

    if start_loading:
        state.start(exit_on_failure=exit_on_load_failure)
    return app
