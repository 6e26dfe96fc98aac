"""wetext's normalisation in a worker process: the same text as in the service's process, a
worker that dies replaced at the next call, short texts kept on the caller's thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chattts_service.domain.text import NORMALISER
from chattts_service.inference import normalising
from chattts_service.inference.normalising import NormaliserProcess

SENTENCES = [
    "今天是2024年3月5日。",
    "会议在下午3:30开始，预算是1,250元。",
    "It is 3:30 pm on Jan 5, 2024.",
    "The 2nd floor costs $12.50 [uv_break] per hour.",
    "第12段：今天我们整理了项目的进度。",
    "[laugh_0] 好的！",
    "Call 555-0100 or write to room 42B.",
    "没有数字的句子。",
    "温度是-5°C，湿度85%。",
    "Version 3.11 shipped on 2023-10-02.",
]


@pytest.fixture
def worker():
    process = NormaliserProcess()
    try:
        yield process
    finally:
        process.close()


def test_the_worker_gives_the_text_the_service_would_have(worker):
    assert len(SENTENCES) > normalising.HERE_AT_MOST  # so the worker normalises them
    for language in ("zh", "en", None):
        assert worker.many(SENTENCES, language) == [NORMALISER(s, language) for s in SENTENCES]
    assert worker.worker_pid() not in (None, os.getpid())


def test_a_few_sentences_are_normalised_on_the_callers_thread(worker):
    few = SENTENCES[: normalising.HERE_AT_MOST]
    assert worker.many(few) == [NORMALISER(s) for s in few]
    assert worker.worker_pid() is None  # no process started for them


def test_a_worker_that_dies_is_replaced_at_the_next_call(worker):
    worker.warm_up()
    first = worker.worker_pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(first):
        time.sleep(0.05)
    assert worker.many(SENTENCES) == [NORMALISER(s) for s in SENTENCES]
    assert worker.restarts == 1
    assert worker.worker_pid() not in (None, first)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie until the pool reaps it: dead for this test's purpose
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_worker_leaves_when_the_service_is_killed(tmp_path):
    """Killed (SIGKILL: nothing runs to stop the worker), the service's process leaves no
    worker waiting for calls for ever."""
    code = (
        "import time\n"
        "from chattts_service.inference.normalising import NormaliserProcess\n"
        "worker = NormaliserProcess()\n"
        "worker.warm_up()\n"
        "print(worker.worker_pid(), flush=True)\n"
        "time.sleep(120)\n"
    )
    root = Path(__file__).resolve().parent.parent
    service = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root
    )
    try:
        pid = int(service.stdout.readline())
    finally:
        service.kill()
        service.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the worker outlived the service's process")
