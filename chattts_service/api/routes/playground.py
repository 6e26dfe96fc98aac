"""The playground page (``GET /``) and the small status document it polls (``GET /status``)."""

from __future__ import annotations

import time
from importlib import resources

from flask import Blueprint, Response, current_app, jsonify

from chattts_service.api.openapi import operation
from chattts_service.runtime import heap

blueprint = Blueprint("playground", __name__)


@blueprint.get("/")
@operation("The playground page (HTML, no external assets)", described="HTML")
def page():
    html = resources.files("chattts_service.api").joinpath("static/index.html").read_bytes()
    response = Response(html, content_type="text/html; charset=utf-8")
    response.headers["Cache-Control"] = "no-cache"
    return response


@blueprint.get("/status")
@operation(
    "Service status for the playground: state, queue, cache, recent latency and real-time "
    "factor, degraded mode, model, uptime",
    described="Status object",
    errors=(401,),
)
def status():
    """What the operators see, as one small JSON object (not Prometheus text)."""
    state = current_app.extensions["chattts"]
    engine, settings = state.engine, state.settings
    body = {
        "status": state.serving_phase,
        "uptime_seconds": round(time.monotonic() - state.started_at, 1),
        "model": engine.model_name,
        "quantization": settings.quantize,
        "linears": engine.gpt_linear_kernel,  # what multiplies them: vnni, avx2, fbgemm, ...
        "kernels": engine.kernels,
        "kernel_tuning": engine.kernel_tuning,  # the int8 product's prefetching, and why
        "decoder": settings.resolved_decoder_dtype,
        "allocator": heap.allocator(),  # jemalloc, or the system's (glibc)
        "degraded": state.degraded,
        "cpu_percent": round(state.pressure.last_percent, 1) if state.pressure else None,
        "queue_depth": engine.scheduler.depth,
        "max_batch": engine.policy.max_batch,
        "cache_entries": len(state.cache),
        "cache_megabytes": round(state.cache.bytes / 2**20, 1),
        "auth_required": state.api_keys.enabled,
        **state.recent.summary(),
        **({"download": state.download.snapshot()} if state.phase == "downloading" else {}),
    }
    return jsonify(body)
