"""The first run: an empty model directory is fetched from the hub, for real, over loopback.

The hub is a stand-in (tests/fakehub.py) that speaks the protocol huggingface_hub uses and
serves the tiny model; the service, huggingface_hub and the HTTP between them are the real ones.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time

import pytest
import requests
from fakehub import FakeHub

from chattts_service.config import Settings
from chattts_service.inference import download, model_files
from chattts_service.inference.model_files import MODEL_FILES, ModelFilesError, sha256_of


@pytest.fixture()
def hub_files(tiny_model_dir, tmp_path):
    """The tiny model as the hub holds it, and the sha256 list its files must match."""
    root = tmp_path / "hub"
    shutil.copytree(tiny_model_dir, root)
    sums = tmp_path / "sha256.json"
    sums.write_text(json.dumps({rel: sha256_of(root / rel) for rel in MODEL_FILES}))
    return root, sums


def _closed_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _settings(model_dir, sums, **overrides) -> Settings:
    return Settings.from_env(
        {}, model_dir=model_dir, verify_model=True, model_checksums=str(sums), **overrides
    )


def _server_settings(model_dir, sums, hub_url) -> dict:
    return {
        "CHATTTS_MODEL_DIR": str(model_dir),
        "CHATTTS_VERIFY_MODEL": "1",
        "CHATTTS_MODEL_CHECKSUMS": str(sums),
        "CHATTTS_WARMUP": "0",
        "HF_ENDPOINT": hub_url,
    }


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _readyz(server) -> dict | None:
    try:
        answer = requests.get(server.url + "/readyz", timeout=2)
    except requests.RequestException:
        return None
    return {"code": answer.status_code, **answer.json()}


def test_first_start_downloads_and_serves_and_a_restart_needs_no_hub(
    start_server, hub_files, tmp_path, monkeypatch
):
    root, sums = hub_files
    model_dir = tmp_path / "volume" / "chattts"
    with FakeHub(root) as hub:
        hub.bytes_per_second = 2_000_000  # slow enough to watch it happen
        server = start_server(**_server_settings(model_dir, sums, hub.url))
        seen = _wait(
            lambda: (
                (r := _readyz(server))
                and r.get("phase") == "downloading"
                and r.get("bytes_total")
                and r
            ),
            60,
            "/readyz to report the download",
        )
        assert seen["code"] == 503 and 0 <= seen["bytes_done"] <= seen["bytes_total"]
        assert (
            seen["bytes_total"]
            == sum((root / rel).stat().st_size for rel in MODEL_FILES)
            + (root / "architecture.json").stat().st_size
        )
        assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
        status = requests.get(server.url + "/status", timeout=5).json()
        assert status["status"] in ("downloading", "loading", "ready")
        server.wait_ready()
        speech = requests.post(server.url + "/synthesize", json={"text": "下载好了"}, timeout=60)
        assert speech.status_code == 200 and speech.content[:4] == b"RIFF"
        assert all(hub.gets(rel) == 1 for rel in MODEL_FILES)
        server.stop()
    # the hub is gone: a restart finds everything verified on the volume
    again = start_server(**_server_settings(model_dir, sums, _closed_endpoint()))
    again.wait_ready()
    assert "downloading" not in again.log_path.read_text()


def test_a_killed_download_resumes_and_never_looks_complete(start_server, hub_files, tmp_path):
    root, sums = hub_files
    model_dir = tmp_path / "model"
    with FakeHub(root) as hub:
        hub.bytes_per_second = 1_000_000
        server = start_server(**_server_settings(model_dir, sums, hub.url))
        _wait(
            lambda: (r := _readyz(server)) and r.get("bytes_done", 0) > 3_000_000,
            60,
            "part of the download",
        )
        os.killpg(server.process.pid, signal.SIGKILL)  # arbiter and worker: no clean-up at all
        server.process.wait(10)
        checksums = json.loads(sums.read_text())
        assert model_files.bad_files(model_dir, checksums), "a killed download looks complete"
        hub.bytes_per_second = None
        again = start_server(**_server_settings(model_dir, sums, hub.url))
        again.wait_ready()
        assert hub.ranges, "the second start fetched everything again instead of resuming"
        assert not model_files.bad_files(model_dir, checksums)


def test_a_corrupt_file_is_caught_and_fetched_again(hub_files, tmp_path, monkeypatch):
    root, sums = hub_files
    model_dir = tmp_path / "model"
    with FakeHub(root) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        settings = _settings(model_dir, sums)
        download.ensure_model(settings)
        assert hub.gets("asset/Decoder.safetensors") == 1
        with open(model_dir / "asset/Decoder.safetensors", "r+b") as handle:
            handle.seek(100)
            handle.write(b"\x00corrupt")
        download.ensure_model(settings)
        assert (model_dir / ".partial/asset/Decoder.safetensors.corrupt").is_file()  # kept aside
        assert hub.gets("asset/Decoder.safetensors") == 2
        assert hub.gets("asset/Vocos.safetensors") == 1  # the good ones stay
        assert not model_files.bad_files(model_dir, json.loads(sums.read_text()))


def test_two_servers_on_one_empty_volume_download_once(start_server, hub_files, tmp_path):
    root, sums = hub_files
    model_dir = tmp_path / "shared"
    with FakeHub(root) as hub:
        hub.bytes_per_second = 2_000_000
        first = start_server(**_server_settings(model_dir, sums, hub.url))
        second = start_server(**_server_settings(model_dir, sums, hub.url))
        first.wait_ready()
        second.wait_ready()
        assert all(hub.gets(rel) == 1 for rel in MODEL_FILES), dict(hub.requests)


def test_an_unreachable_hub_is_one_clear_error_retried_with_a_pause(start_server, tmp_path):
    endpoint = _closed_endpoint()
    server = start_server(
        CHATTTS_MODEL_DIR=str(tmp_path / "empty"), CHATTTS_WARMUP="0", HF_ENDPOINT=endpoint
    )
    seen = _wait(
        lambda: (r := _readyz(server)) and r.get("error") and r, 60, "the download's error"
    )
    assert seen["code"] == 503 and seen["phase"] == "downloading"
    assert endpoint in seen["error"] and "HF_ENDPOINT" in seen["error"]
    assert "copy the model files" in seen["error"]
    assert seen["retry_in_seconds"] >= 1
    time.sleep(3)
    assert server.process.poll() is None  # waiting to try again, not restarting
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
    assert server.log_path.read_text().count("Traceback") == 0


@pytest.mark.parametrize("status", [401, 404, 500])
def test_a_hub_that_refuses_is_a_clear_error(hub_files, tmp_path, monkeypatch, status):
    root, sums = hub_files
    with FakeHub(root) as hub:
        hub.fail_with = status
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(download.DownloadFailed, match=hub.url) as caught:
            download.ensure_model(_settings(tmp_path / "model", sums))
        assert str(status) in str(caught.value)


def test_never_downloads_when_told_not_to(hub_files, tmp_path, monkeypatch):
    root, sums = hub_files
    with FakeHub(root) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        (tmp_path / "model").mkdir()
        with pytest.raises(ModelFilesError, match="missing asset/Vocos.safetensors"):
            download.ensure_model(_settings(tmp_path / "model", sums, download="never"))
        assert not hub.requests
