"""The production server: gunicorn, one worker (the model is loaded once), threads for I/O."""

from __future__ import annotations

import logging
import os
import sys

from gunicorn.app.base import BaseApplication

from .config import Settings, SettingsError


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # ChatTTS logs every stage of every inference at INFO.
    logging.getLogger("ChatTTS").setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))


def pin_compute_threads(settings: Settings) -> None:
    """OpenMP/MKL read these once, when torch is first imported: set them before that."""
    threads = str(settings.torch_threads)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)


class _Gunicorn(BaseApplication):
    def __init__(self, settings: Settings):
        self.settings = settings
        super().__init__()

    def load_config(self):
        s = self.settings
        options = {
            "bind": f"{s.host}:{s.port}",
            "workers": 1,
            "worker_class": "gthread",
            "threads": s.http_threads,
            # gthread workers heartbeat from their main thread, so a long synthesis is not
            # mistaken for a hung worker; the timeout only catches a truly stuck process.
            "timeout": s.worker_timeout,
            "graceful_timeout": 30,
            "keepalive": 5,
            "accesslog": None,
            "errorlog": "-",
            "control_socket_disable": True,
            "loglevel": s.log_level.lower(),
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        from .app import create_app

        configure_logging(self.settings.log_level)
        return create_app(self.settings, exit_on_load_failure=True)


def main() -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    pin_compute_threads(settings)
    _Gunicorn(settings).run()
    return 0
