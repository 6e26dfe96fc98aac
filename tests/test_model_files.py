import shutil
import socket
import subprocess
import sys

import pytest

from chattts_service.inference import model_files
from chattts_service.inference.model_files import MODEL_FILES, ModelFilesError
from chattts_service.tools import model as model_tool


def test_shipped_checksums_cover_every_file():
    checksums = model_files.shipped_checksums()
    assert set(checksums) == set(MODEL_FILES)
    assert all(len(value) == 64 for value in checksums.values())


def test_random_model_fails_verification_naming_the_files(tiny_model_dir):
    with pytest.raises(ModelFilesError) as caught:
        model_files.verify(tiny_model_dir)
    message = str(caught.value)
    assert "asset/gpt/model.safetensors" in message
    assert "CHATTTS_VERIFY_MODEL=0" in message


def test_verification_passes_on_matching_checksums_and_names_a_corrupt_file(
    tiny_model_dir, tmp_path
):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    checksums = {rel: model_files.sha256_of(copy / rel) for rel in MODEL_FILES}
    model_files.verify(copy, checksums)  # no exception
    with open(copy / "asset/Decoder.safetensors", "r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00corrupt")
    with pytest.raises(ModelFilesError, match=r"asset/Decoder\.safetensors") as caught:
        model_files.verify(copy, checksums)
    assert "Vocos" not in str(caught.value)


def test_missing_file_is_named(tiny_model_dir, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "asset/Embed.safetensors").unlink()
    with pytest.raises(ModelFilesError, match=r"missing asset/Embed\.safetensors"):
        model_files.check_present(copy)
    with pytest.raises(ModelFilesError, match="does not exist"):
        model_files.check_present(tmp_path / "nowhere")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_download_from_an_unreachable_hub_is_a_clear_error(tmp_path, monkeypatch):
    # A loopback port nobody listens on stands in for a hub we cannot reach.
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "2")
    with pytest.raises(ModelFilesError) as caught:
        model_tool.download(tmp_path / "weights", endpoint=endpoint)
    message = str(caught.value)
    assert "2Noise/ChatTTS" in message and endpoint in message


def test_download_command_line(tmp_path):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "chattts_service.tools.model",
            "download",
            str(tmp_path / "w"),
            "--endpoint",
            endpoint,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith("error: could not download 2Noise/ChatTTS")
    bad = subprocess.run(
        [sys.executable, "-m", "chattts_service.tools.model", "fetch"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_verify_command_line(tiny_model_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "chattts_service.tools.model",
            "verify",
            str(tiny_model_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "fail verification" in result.stderr
