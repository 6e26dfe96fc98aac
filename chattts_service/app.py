"""The Flask application factory: nothing heavy happens at import time."""

from __future__ import annotations

import platform
from collections.abc import Callable

from flask import Flask

from chattts_service.api import context
from chattts_service.api.auth import ApiKeys
from chattts_service.api.errors import register_error_handlers
from chattts_service.api.hooks import log_requests, require_api_key
from chattts_service.api.routes import (
    admin,
    document,
    health,
    openai,
    playground,
    synthesis,
    voices,
)
from chattts_service.config import Settings
from chattts_service.inference.engine import Engine
from chattts_service.inference.policy import KNOBS
from chattts_service.runtime.metrics import Metrics
from chattts_service.runtime.pressure import Pressure
from chattts_service.services.cache import AudioCache
from chattts_service.services.service import Service

# a JSON request body: the longest valid speech body is well under it (the transport reads
# up to its own larger bound, so multipart voice uploads arrive whole; routes taking forms
# raise this for themselves)
MAX_JSON_BODY_BYTES = 64 * 1024
BLUEPRINTS = (health, synthesis, openai, voices, playground, admin, document)


def create_app(
    settings: Settings | None = None,
    *,
    engine: Engine | None = None,
    start_loading: bool = True,
    exit_on_load_failure: bool = False,
) -> Flask:
    """Build the service: settings -> metrics, engine, cache, pipeline -> routes. With
    ``start_loading`` the model loads and warms up on a background thread."""
    settings = settings or Settings.from_env()
    app = Flask(__name__, static_folder="api/static")
    app.config["MAX_CONTENT_LENGTH"] = MAX_JSON_BODY_BYTES
    app.json.ensure_ascii = False  # type: ignore[attr-defined]  # Flask's default provider

    service = build_service(settings, engine)
    api_keys = ApiKeys.from_settings(settings)
    context.install(app, service, api_keys)
    require_api_key(app, api_keys, settings.metrics_auth, service.metrics.auth_failures.inc)
    log_requests(app)
    register_error_handlers(app)
    for module in BLUEPRINTS:
        app.register_blueprint(module.blueprint)

    if start_loading:
        service.start(exit_on_failure=exit_on_load_failure)
    return app


def build_service(settings: Settings, engine: Engine | None = None) -> Service:
    """Everything one running service holds, wired together."""
    metrics = Metrics()
    engine = engine or Engine(
        settings,
        step_observer=metrics.observe_step,
        decode_observer=metrics.observe_decode,
        prefill_observer=metrics.observe_prefill,
        stall_observer=metrics.observe_stall,
        admitted_observer=metrics.observe_admitted,
        taken_back_observer=metrics.observe_taken_back,
    )
    service = Service(
        settings=settings,
        engine=engine,
        cache=AudioCache(settings.cache_size, settings.cache_mb * 2**20),
        metrics=metrics,
        pressure=Pressure(settings.degrade_cpu_percent, settings.degrade_after_s),
    )
    # gauges read when scraped
    metrics.degraded.set_function(lambda: float(service.degraded))

    def knob(name: str) -> Callable[[], float]:
        return lambda: float(engine.policy.snapshot()[name])

    for name in KNOBS:
        metrics.config.labels(setting=name).set_function(knob(name))
    metrics.segments_queued.set_function(lambda: float(engine.scheduler.depth))
    metrics.kernels.describe = lambda: (
        platform.machine(),
        engine.kernels,
        engine.gpt_linear_kernel or "none",
        engine.kernel_instructions,
    )
    return service
