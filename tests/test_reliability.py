"""Reliability and security over real HTTP: API keys, draining on SIGTERM, admission, degraded
mode, a worker killed mid-request, logs on a full disk, and a bounded schema fuzz."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
from conftest import REPO

KEY = "test-key-0123456789abcdef"


def metric(server, name: str, label: str = "") -> float:
    text = requests.get(
        server.url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {KEY}"}
    ).text
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.split()[-1])
    return 0.0


# -- API keys -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(start_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# operators\nfile-key-abcdefghijklmnop\n", encoding="utf-8")
    server = start_server(
        CHATTTS_API_KEYS=KEY,
        CHATTTS_API_KEYS_FILE=str(keys),
        CHATTTS_METRICS_AUTH="1",
        CHATTTS_MAX_NEW_TOKENS="100",
    )
    server.wait_ready()
    return server


def test_api_keys_guard_everything_but_the_probes(keyed):
    body = {"text": "鉴权测试", "seed": 1}
    missing = requests.post(keyed.url + "/synthesize", json=body, timeout=60)
    assert missing.status_code == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
    assert "API key" in missing.json()["error"]
    wrong = requests.post(
        keyed.url + "/synthesize",
        json=body,
        timeout=60,
        headers={"Authorization": "Bearer " + KEY[:-1] + "x"},
    )
    assert wrong.status_code == 401
    not_bearer = requests.post(
        keyed.url + "/synthesize", json=body, timeout=60, headers={"Authorization": "Basic " + KEY}
    )
    assert not_bearer.status_code == 401
    for key in (KEY, "file-key-abcdefghijklmnop"):
        ok = requests.post(
            keyed.url + "/synthesize",
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {key}"},
        )
        assert ok.status_code == 200
    openai_shape = requests.post(
        keyed.url + "/v1/audio/speech",
        timeout=60,
        json={"model": "tts-1", "voice": "alloy", "input": "hi"},
    )
    assert openai_shape.status_code == 401
    assert openai_shape.json()["error"]["type"] == "authentication_error"
    for path in ("/healthz", "/readyz", "/openapi.json"):
        assert requests.get(keyed.url + path, timeout=10).status_code == 200
    assert requests.get(keyed.url + "/metrics", timeout=10).status_code == 401  # METRICS_AUTH
    assert metric(keyed, "chatts_auth_failures_total") >= 4
    assert KEY not in keyed.log() and "file-key" not in keyed.log()


def test_a_missing_key_file_stops_the_start(tmp_path, tiny_model_dir):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CHATTTS_")},
        "CHATTTS_MODEL_DIR": str(tiny_model_dir),
        "CHATTTS_VERIFY_MODEL": "0",
        "CHATTTS_API_KEYS_FILE": str(tmp_path / "absent.txt"),
        "CHATTTS_PORT": "1",
    }
    result = subprocess.run(
        [sys.executable, "server.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "CHATTTS_API_KEYS_FILE" in result.stderr


def test_short_keys_are_refused():
    from chattts_service.api.auth import ApiKeys
    from chattts_service.config import Settings, SettingsError

    with pytest.raises(SettingsError, match="at least 16"):
        ApiKeys.from_settings(Settings.from_env({}, api_keys="short"))
    keys = ApiKeys.from_settings(Settings.from_env({}, api_keys=f" {KEY} , other-key-0123456789 "))
    assert keys.allows(f"Bearer {KEY}") and keys.allows("bearer other-key-0123456789")
    assert not keys.allows(None) and not keys.allows("Bearer") and not keys.allows(KEY)


# -- SIGTERM: drain, finish in-flight work, exit ---------------------------------------------


def test_sigterm_drains_then_finishes_in_flight_requests(start_server, tiny_endless_model_dir):
    """SIGTERM: readiness and new requests answer 503 for the drain, and a request in flight
    goes on past it (gunicorn's graceful stop waits for it) and gets its whole answer. Its
    speech never ends early (the endless model), so it outlasts the drain on any CPU."""
    drain = 2
    server = start_server(
        tiny_endless_model_dir,
        CHATTTS_DRAIN_SECONDS=str(drain),
        CHATTTS_GRACEFUL_TIMEOUT_S="60",
        CHATTTS_MAX_NEW_TOKENS="2048",
    )
    server.wait_ready()
    long_text = "这是一段用来测试优雅退出的长文本，它会被切成好几段。" * 60
    results = {}

    def in_flight():
        results["response"] = requests.post(
            server.url + "/synthesize", timeout=120, json={"text": long_text, "seed": 3}
        )

    thread = threading.Thread(target=in_flight)
    thread.start()
    deadline = time.monotonic() + 30
    while metric(server, "chatts_queue_depth") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(server, "chatts_queue_depth") >= 1, "the long request never started"
    os.kill(server.process.pid, signal.SIGTERM)  # gunicorn's arbiter, as docker stop does
    signalled = time.monotonic()
    while True:  # the signal reaches the worker through the arbiter
        ready = requests.get(server.url + "/readyz", timeout=5)
        if ready.json()["status"] == "draining" or time.monotonic() > signalled + drain / 2:
            break
        time.sleep(0.02)
    assert ready.status_code == 503 and ready.json()["status"] == "draining", ready.text
    refused = requests.post(server.url + "/synthesize", json={"text": "新请求"}, timeout=10)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"], refused.text
    time.sleep(max(0.0, signalled + drain + 0.5 - time.monotonic()))
    assert thread.is_alive(), "the request ended within the drain: it shows nothing past it"
    thread.join(timeout=120)
    response = results["response"]
    assert response.status_code == 200, response.text
    assert int(response.headers["X-Segments"]) > 1
    assert server.process.wait(timeout=60) == 0
    assert "draining" in server.log()


def test_readiness_and_its_body_always_agree(tiny_model_dir):
    """/readyz answers 200 exactly when its body says "ready", whatever the phase: the
    handler reads the phase once. A drain that begins as the phase turns "ready" (the loader
    and a SIGTERM at the same moment) reads as draining, not ready."""
    from chattts_service.api.context import service_of
    from chattts_service.app import create_app
    from chattts_service.config import Settings

    app = create_app(Settings.from_env({}, model_dir=tiny_model_dir), start_loading=False)
    state, client = service_of(app), app.test_client()
    for phase in ("starting", "downloading", "loading", "warming", "failed", "ready"):
        state.phase = phase
        answer = client.get("/readyz")
        assert (answer.status_code == 200) == (answer.get_json()["status"] == "ready"), phase
        assert answer.get_json()["status"] == phase and state.ready == (phase == "ready")
    state.draining = True  # the flag set while the phase still reads "ready"
    answer = client.get("/readyz")
    assert answer.status_code == 503 and answer.get_json()["status"] == "draining"
    assert not state.ready
    state.draining = False
    state.drain()
    answer = client.get("/readyz")
    assert answer.status_code == 503 and answer.get_json()["status"] == "draining"


# -- admission and degraded mode ------------------------------------------------------------------


def test_admission_refuses_when_the_estimated_wait_is_too_long(tiny_model_dir):
    from engines import engine_on

    from chattts_service.domain.speech import Overloaded, SynthesisRequest

    with engine_on(tiny_model_dir, max_wait_s=5, max_batch=2, max_segment_chars=10) as engine:
        assert engine.estimated_wait() is None  # nothing measured yet: admit
        engine.synthesize(SynthesisRequest("先跑一个", 1), fixed_steps=10)
        assert 0 < engine.estimated_wait() < 5
        engine.admission.assume_job_seconds(4.0)  # as if recent jobs took 4 s each
        assert engine.estimated_wait(1) == 4.0  # one batch of up to 2
        assert engine.estimated_wait(3) == 8.0  # two batches
        with pytest.raises(Overloaded) as refused:
            engine.start(SynthesisRequest("这是第一句话了。这是第二句话了。这是第三句话了。", 2))
        assert refused.value.reason == "wait" and refused.value.retry_after == 8.0


def test_pressure_switches_after_the_hold_time_both_ways():
    from chattts_service.runtime.pressure import Pressure

    changes = []
    pressure = Pressure(85, 10, on_change=changes.append)
    for second in range(10):
        pressure.observe(95, float(second))
    assert not pressure.degraded  # 9 s above: not yet
    pressure.observe(95, 10.0)
    assert pressure.degraded and changes == [True]
    pressure.observe(50, 11.0)
    pressure.observe(90, 12.0)  # back above: the calm period starts again
    for second in range(13, 23):
        pressure.observe(40, float(second))
    assert pressure.degraded
    pressure.observe(40, 23.0)
    assert not pressure.degraded and changes == [True, False]


def test_degraded_mode_skips_refinement(start_server):
    server = start_server(
        CHATTTS_DEGRADE_CPU_PERCENT="1", CHATTTS_DEGRADE_AFTER_S="1", CHATTTS_MAX_NEW_TOKENS="100"
    )
    server.wait_ready()
    stop = threading.Event()

    def load():  # keep the CPU busy until degraded mode is on
        seed = 100
        while not stop.is_set():
            requests.post(
                server.url + "/synthesize", json={"text": "压力", "seed": seed}, timeout=60
            )
            seed += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while metric(server, "chatts_degraded") != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(server, "chatts_degraded") == 1
        body = {"text": "降级测试", "seed": 5, "refine_text": True}
        first = requests.post(server.url + "/synthesize", json=body, timeout=60)
        again = requests.post(server.url + "/synthesize", json=body, timeout=60)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert first.status_code == again.status_code == 200
    assert first.headers["X-Degraded"] == again.headers["X-Degraded"] == "1"
    # refinement was skipped: the answer is the unrefined speech, cached under that key
    # (this tiny model's segments end long before the lowered cap)
    assert first.headers["X-Cache"] == "MISS" and again.headers["X-Cache"] == "HIT"
    unrefined = requests.post(
        server.url + "/synthesize",
        timeout=60,
        json={"text": "降级测试", "seed": 5, "refine_text": False},
    )
    assert unrefined.headers["X-Cache"] == "HIT" and unrefined.content == first.content
    assert "degraded mode on" in server.log()


# -- faults ---------------------------------------------------------------------------------------


def _worker_pid(server) -> int:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(server.process.pid)], capture_output=True, text=True
    ).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def test_a_killed_worker_is_replaced_and_the_service_is_ready_again(start_server):
    server = start_server(CHATTTS_MAX_NEW_TOKENS="200")
    server.wait_ready()
    worker = _worker_pid(server)
    results = {}

    def in_flight():
        try:
            results["status"] = requests.post(
                server.url + "/synthesize",
                timeout=60,
                json={"text": "被打断的请求。" * 40, "seed": 1},
            ).status_code
        except requests.ConnectionError as error:
            results["error"] = error

    thread = threading.Thread(target=in_flight)
    thread.start()
    time.sleep(0.3)
    os.kill(worker, signal.SIGKILL)
    thread.join(timeout=60)
    assert "error" in results or results.get("status") == 200  # cut off, or done before the kill
    server.wait_ready(timeout=120)
    assert _worker_pid(server) != worker
    after = requests.post(
        server.url + "/synthesize", json={"text": "又好了", "seed": 2}, timeout=60
    )
    assert after.status_code == 200


def test_logs_on_a_full_disk_do_not_stop_serving(tiny_model_dir, tmp_path):
    from benchmarks.serverproc import free_port

    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CHATTTS_")},
        "CHATTTS_MODEL_DIR": str(tiny_model_dir),
        "CHATTTS_VERIFY_MODEL": "0",
        "CHATTTS_HOST": "127.0.0.1",
        "CHATTTS_PORT": str(port),
        "CHATTTS_THREADS": "1",
        "CHATTTS_MAX_NEW_TOKENS": "100",
    }
    with open("/dev/full", "wb") as full:  # every write fails with ENOSPC
        process = subprocess.Popen(
            [sys.executable, "server.py"],
            cwd=REPO,
            env=env,
            stdout=full,
            stderr=full,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, "the server died writing its logs"
            try:
                if requests.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        for seed in range(3):
            response = requests.post(
                url + "/synthesize", json={"text": "磁盘满了", "seed": seed}, timeout=60
            )
            assert response.status_code == 200
        bad = requests.post(url + "/synthesize", json={"text": ""}, timeout=10)
        assert bad.status_code == 400
        assert process.poll() is None
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


# -- tuning without a restart ---------------------------------------------------------------------


def test_batching_can_be_tuned_on_a_running_server(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert requests.get(keyed.url + "/admin/config", timeout=10).status_code == 401
    shown = requests.get(keyed.url + "/admin/config", headers=auth, timeout=10).json()
    assert shown["current"]["max_batch"] == 8 and shown["limits"]["max_batch"]["max"] == 8
    assert shown["current"]["bulk_min_rows"] == 1 and shown["current"]["stall_budget_ms"] == 40
    assert shown["scheduling"][0].startswith("interactive") and len(shown["scheduling"]) == 5
    changed = requests.post(
        keyed.url + "/admin/config",
        headers=auth,
        timeout=10,
        json={"max_batch": 2, "batch_wait_ms": 10, "max_queue": 5, "stall_budget_ms": 25},
    )
    assert changed.status_code == 200
    assert changed.json()["current"] == {
        "max_batch": 2,
        "batch_wait_ms": 10,
        "max_queue": 5,
        "max_wait_s": 120,
        "bulk_min_rows": 1,
        "bulk_rows_while_starting": 1,
        "stall_budget_ms": 25,
    }
    assert metric(keyed, "chatts_config", 'setting="stall_budget_ms"') == 25
    assert metric(keyed, "chatts_config", 'setting="max_batch"') == 2
    assert metric(keyed, "chatts_config", 'setting="max_queue"') == 5
    # the new bound holds: 8 segments do not fit a queue of 5
    refused = requests.post(
        keyed.url + "/synthesize",
        headers=auth,
        timeout=60,
        json={"text": "这是第一句话。" * 100, "seed": 1},
    )
    assert refused.status_code == 503 and "no room for 8 segment(s)" in refused.json()["error"]
    for body, fragment in [
        ({"max_batch": 9}, "between 1 and 8"),
        ({"max_batch": 0}, "between 1 and 8"),
        ({"batch_wait_ms": -1}, "between 0 and 10000"),
        ({"max_batch": 2.5}, "an integer"),
        ({"threads": 4}, "unknown"),
        ({}, "send one or more"),
    ]:
        bad = requests.post(keyed.url + "/admin/config", headers=auth, json=body, timeout=10)
        assert bad.status_code == 400 and fragment in bad.json()["error"], (body, bad.text)
    ok = requests.post(
        keyed.url + "/synthesize", headers=auth, json={"text": "调好了", "seed": 2}, timeout=60
    )
    assert ok.status_code == 200
    requests.post(
        keyed.url + "/admin/config",
        headers=auth,
        timeout=10,
        json={"max_batch": 8, "batch_wait_ms": 0, "max_queue": 64, "stall_budget_ms": 40},
    )


def test_admin_endpoint_refuses_without_keys(start_server):
    server = start_server(CHATTTS_MAX_NEW_TOKENS="50", CHATTTS_WARMUP="0")
    server.wait_ready()
    response = requests.post(server.url + "/admin/config", json={"max_batch": 2}, timeout=10)
    assert response.status_code == 403 and "API keys" in response.json()["error"]
