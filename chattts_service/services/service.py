"""What one running service holds, and its life: settings, engine, cache, metrics, the services
the API calls (speech, voices, admin), and loading -> warming -> ready -> draining.

The API reaches the service through ``Service``'s services and lifecycle alone; the engine is
this module's to own and hand to them, never a handler's to touch.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from chattts_service.config import Settings
from chattts_service.inference.download import DownloadFailed, DownloadProgress, ensure_model
from chattts_service.inference.engine import Engine
from chattts_service.inference.model_files import ModelFilesError
from chattts_service.runtime import heap
from chattts_service.runtime.metrics import Metrics
from chattts_service.runtime.pressure import Pressure
from chattts_service.services.admin import AdminService
from chattts_service.services.cache import AudioCache
from chattts_service.services.speech import SpeechPipeline
from chattts_service.services.voices import VoiceService

log = logging.getLogger(__name__)

# gunicorn's exit status for "the worker failed to boot": the arbiter then stops for good
# instead of restarting a worker that can never load its model.
WORKER_BOOT_ERROR = 3
# pauses between attempts to reach the hub
FIRST_RETRY_SECONDS = 5.0
MAX_RETRY_SECONDS = 300.0


class RecentRequests:
    """The last answered speech requests, for the status page: latency, audio, cache."""

    def __init__(self, size: int = 60):
        self._items: deque[tuple[float, float, str]] = deque(maxlen=size)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.in_flight = 0

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1

    def end(self, seconds: float, audio_seconds: float, cache: str | None) -> None:
        with self._lock:
            self.in_flight -= 1
            if cache is None:  # failed: counts as in-flight no more, nothing to show
                return
            self._items.append((round(seconds, 4), round(audio_seconds, 3), cache))
            if cache == "HIT":
                self.hits += 1
            else:
                self.misses += 1

    def summary(self) -> dict[str, Any]:
        with self._lock:
            items = list(self._items)
            hits, misses, in_flight = self.hits, self.misses, self.in_flight
        synthesised = [s / a for s, a, c in items if c == "MISS" and a > 0]
        return {
            "in_flight": in_flight,
            "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
            "recent_latency_seconds": [s for s, _, _ in items],
            "recent_real_time_factor": statistics.median(synthesised) if synthesised else None,
        }


@dataclass
class Service:
    settings: Settings
    engine: Engine
    cache: AudioCache
    metrics: Metrics
    pressure: Pressure | None = None
    draining: bool = False  # SIGTERM received: refuse new work, finish what is running
    recent: RecentRequests = field(default_factory=RecentRequests)
    started_at: float = field(default_factory=time.monotonic)
    phase: str = "starting"  # starting -> loading -> warming -> ready | failed
    failure: str | None = None
    download: DownloadProgress = field(default_factory=DownloadProgress)
    # the services the API calls
    speech: SpeechPipeline = field(init=False)  # both speech endpoints
    voices: VoiceService = field(init=False)  # voices and consents
    admin: AdminService = field(init=False)  # the knobs of the running service

    def __post_init__(self) -> None:
        self.speech = SpeechPipeline(self.settings, self.engine, self.cache, self.metrics)
        self.voices = VoiceService(self.settings, self.engine, lambda: self.serving_phase)
        self.admin = AdminService(self.engine, lambda: self.serving_phase)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def status(self) -> dict[str, Any]:
        """What the operators see on the status page (``/status``): the phase, the model and
        how it computes, the queue, the cache, recent requests, degraded mode."""
        engine, settings = self.engine, self.settings
        return {
            "status": self.serving_phase,
            "uptime_seconds": round(time.monotonic() - self.started_at, 1),
            "model": engine.model_name,
            "quantization": settings.quantize,
            "architecture": platform.machine(),  # x86_64 or aarch64
            "linears": engine.gpt_linear_kernel,  # what multiplies them: vnni, i8mm, fbgemm...
            "kernels": engine.kernels,
            "instructions": engine.kernel_instructions,  # the kernels' product, int4's too
            "kernel_tuning": engine.kernel_tuning,  # the int8 product's prefetching, and why
            "decoder": settings.resolved_decoder_dtype,
            "allocator": heap.allocator(),  # jemalloc, or the system's (glibc)
            "degraded": self.degraded,
            "cpu_percent": round(self.pressure.last_percent, 1) if self.pressure else None,
            "queue_depth": engine.scheduler.depth,
            "max_batch": engine.policy.max_batch,
            "cache_entries": len(self.cache),
            "cache_megabytes": round(self.cache.bytes / 2**20, 1),
            **self.recent.summary(),
            **({"download": self.download.snapshot()} if self.phase == "downloading" else {}),
        }

    @property
    def serving_phase(self) -> str:
        """The phase to report, "ready" exactly when serving: "draining" once a drain began,
        else the phase. A caller that reads it once reports what decided its answer (a 503
        never says "ready"): the phase turns "ready" after everything serving needs is up,
        and "draining" before the draining flag is set."""
        return "draining" if self.draining else self.phase

    @property
    def ready(self) -> bool:
        return self.serving_phase == "ready"

    @property
    def degraded(self) -> bool:
        return self.pressure is not None and self.pressure.degraded

    def drain(self) -> None:
        """Stop taking new work: readiness and new requests answer 503 from now on."""
        if not self.draining:
            log.info("draining: new requests get 503; in-flight requests finish")
        self.phase = "draining"
        self.draining = True
        self.metrics.ready.set(0)

    def start(self, exit_on_failure: bool) -> threading.Thread:
        thread = threading.Thread(
            target=self._load_and_warm, args=(exit_on_failure,), name="model-loader", daemon=True
        )
        thread.start()
        # the model thread stops (between two steps) before the interpreter finalises: a
        # thread left inside torch's OpenMP code at exit aborts the process (Debian's torch)
        atexit.register(self.engine.close)
        return thread

    def _fetch_model(self) -> None:
        """Make the model directory complete, downloading it where allowed. A hub that cannot
        be reached is tried again after a growing pause (the process stays up and says why in
        /readyz), never in a tight loop of restarts."""
        pause = FIRST_RETRY_SECONDS
        while True:
            try:
                ensure_model(self.settings, self.download, on_download=self._downloading)
                self.download.update(error=None, retry_at=None)
                self.failure = None
                return
            except DownloadFailed as error:
                log.error("%s; trying again in %.0f s", error, pause)
                self.failure = str(error)
                self.download.update(error=str(error), retry_at=time.monotonic() + pause)
                time.sleep(pause)
                pause = min(pause * 2, MAX_RETRY_SECONDS)

    def _downloading(self) -> None:
        self.phase = "downloading"

    def _load_and_warm(self, exit_on_failure: bool) -> None:
        try:
            self.phase = "loading"
            self._fetch_model()
            self.phase = "loading"
            self.engine.load()
            model = self.engine.model
            assert model is not None  # loaded just above
            self.metrics.prompt_prefixes.store = model.transformer.prefixes
            if self.settings.warmup:
                self.phase = "warming"
                self.engine.warm_up()
        except Exception as error:  # any failure here is fatal to serving
            self.phase, self.failure = "failed", str(error)
            if isinstance(error, ModelFilesError):
                log.error("cannot start: %s", error)
            else:
                log.exception("cannot start: loading the model failed")
            if exit_on_failure:
                logging.shutdown()
                os._exit(WORKER_BOOT_ERROR)
            return
        if self.pressure is not None:
            self.pressure.start()
        if not self.draining:  # a SIGTERM while loading: never ready
            self.metrics.ready.set(1)
            self.phase = "ready"
        log.info("ready %.2fs after start", time.monotonic() - self.started_at)
