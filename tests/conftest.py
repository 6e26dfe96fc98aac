"""Shared fixtures: the tiny random-weight model, and a real server process on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serverproc import REPO, Server  # noqa: F401  (REPO: for the tests)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that started servers reports the end of each one's log: a CI run on
    another machine keeps nothing else of them."""
    report = yield
    if report.when == "call" and report.failed:
        for number, server in enumerate(ServerProcess.started_in_test, 1):
            report.sections.append((f"server {number} log (end)", server.log()[-4000:]))
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    ServerProcess.started_in_test.clear()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from chattts_service.tools.testmodel import build

    return build(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_endless_model_dir(tmp_path_factory) -> Path:
    """The tiny model whose speech never ends before the step cap: requests as long as set."""
    from chattts_service.tools.testmodel import build

    return build(tmp_path_factory.mktemp("models") / "tiny-endless", "tiny", 0, speech_ends=False)


class ServerProcess(Server):
    """``python server.py`` as a user runs it, on a loopback port, with the tests' settings
    (at most 200 steps a request, one torch thread) unless given others."""

    started_in_test: list[ServerProcess] = []  # the running test's; a failure shows their logs

    def __init__(self, model_dir: Path, log_path: Path, port: int | None = None, **settings: str):
        super().__init__(
            model_dir,
            log_path,
            port=port,
            **{"CHATTTS_MAX_NEW_TOKENS": "200", "CHATTTS_THREADS": "1", **settings},
        )
        ServerProcess.started_in_test.append(self)

    def wait_ready(self, timeout: float = 120.0) -> float:
        return super().wait_ready(timeout)


@pytest.fixture(scope="session")
def start_server(tiny_model_dir, tmp_path_factory):
    """Start extra servers with their own settings; every one is stopped at the end."""
    started: list[ServerProcess] = []

    def start(model_dir: Path | None = None, **settings: str) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(model_dir or tiny_model_dir, log_path, **settings)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
