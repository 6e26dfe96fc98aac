"""The production server: gunicorn, one worker (the model is loaded once), threads for I/O."""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading

from gunicorn.app.base import BaseApplication

from chattts_service.api.auth import ApiKeys
from chattts_service.api.context import service_of
from chattts_service.config import Settings, SettingsError
from chattts_service.runtime import heap
from chattts_service.transport.intake import MAX_REQUEST_LINE, IntakeLimits, IntakeWorker
from chattts_service.transport.wyoming import WyomingServer

log = logging.getLogger(__name__)


class DrainingWorker(IntakeWorker):
    """The intake worker (whole requests before threads) with a drain before its graceful stop.

    On SIGTERM the service first answers 503 to readiness and to new requests for
    ``CHATTTS_DRAIN_SECONDS`` (load balancers take it out of rotation; a retrying proxy sends
    the new requests elsewhere) while in-flight requests go on; then gunicorn stops accepting
    and gives in-flight requests the rest of the grace period before the process exits."""

    def run(self):
        heap.purge_in_background()
        service = service_of(self.wsgi)
        if service is not None:
            self.limits = IntakeLimits.from_settings(service.settings)
            service.metrics.connections.source = self.update_stats
            settings = service.settings
            if settings.wyoming_port:  # Home Assistant's protocol, beside HTTP, in this process
                WyomingServer(service, settings.host, settings.wyoming_port).start()
        super().run()

    def handle_exit(self, sig, frame):
        service = service_of(self.wsgi)
        drain = service.settings.drain_seconds if service is not None else 0
        if service is None or service.draining or drain <= 0:
            if service is not None:
                service.drain()
            return super().handle_exit(sig, frame)
        service.drain()
        timer = threading.Timer(drain, super().handle_exit, args=(sig, frame))
        timer.daemon = True
        timer.start()


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # ChatTTS logs every stage of every inference at INFO.
    logging.getLogger("ChatTTS").setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))


def pin_compute_threads(settings: Settings) -> None:
    """OpenMP/MKL read these once, when torch is first imported: set them before that."""
    threads = str(settings.torch_threads)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)


def raise_open_file_limit(wanted: int) -> None:
    """Each connection is a descriptor: a soft limit of 1,024 (many containers' default)
    would refuse connections long before ``CHATTTS_HTTP_MAX_CONNECTIONS``. Raised towards
    the hard limit, never above it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info("open file limit raised from %d to %d", soft, target)
    if target < wanted:
        log.warning("open file limit %d is below what %d connections need", target, wanted)


class _Gunicorn(BaseApplication):
    def __init__(self, settings: Settings):
        self.settings = settings
        super().__init__()

    def load_config(self):
        s = self.settings
        options = {
            "bind": f"{s.host}:{s.port}",
            "workers": 1,
            "worker_class": "chattts_service.transport.serve.DrainingWorker",
            "threads": s.http_threads,
            # gthread workers heartbeat from their main thread, so a long synthesis is not
            # mistaken for a hung worker; the timeout only catches a truly stuck process.
            "timeout": s.worker_timeout,
            # the arbiter's limit for the whole stop: the drain, then the in-flight requests
            "graceful_timeout": s.drain_seconds + s.graceful_timeout_s,
            # the intake loop times connections out itself (the HTTP timeout settings); gunicorn's
            # keep-alive only has to be on, and its request line limit equal to the loop's
            "keepalive": s.http_idle_timeout_s,
            "limit_request_line": MAX_REQUEST_LINE,
            "worker_connections": s.http_max_connections,
            "accesslog": None,
            "errorlog": "-",
            "control_socket_disable": True,
            "loglevel": s.log_level.lower(),
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        from chattts_service.app import create_app

        configure_logging(self.settings.log_level)
        return create_app(self.settings, exit_on_load_failure=True)


def main() -> int:
    try:
        settings = Settings.from_env()
        ApiKeys.from_settings(settings)  # a missing or bad key file stops the start here
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    try:
        heap.use_allocator(settings.allocator)  # may re-execute this process on jemalloc
    except heap.AllocatorMissing as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    log.info("memory allocator: %s", heap.allocator())
    raise_open_file_limit(settings.http_max_connections + 256)
    heap.limit_arenas()
    heap.bound_native_caches()
    pin_compute_threads(settings)
    _Gunicorn(settings).run()
    return 0
