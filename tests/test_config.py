import logging
from pathlib import Path

import pytest

from chattts_service.config import Settings, SettingsError
from chattts_service.runtime.cpu import available_cpus


def test_defaults_without_environment():
    settings = Settings.from_env({})
    assert settings.port == 8090
    assert settings.host == "0.0.0.0"
    assert settings.cache_size == 256
    assert settings.verify_model is True
    assert settings.refine_text is False
    assert settings.torch_threads == available_cpus()


def test_values_are_parsed_from_the_environment():
    settings = Settings.from_env(
        {
            "CHATTTS_PORT": "9000",
            "CHATTTS_VERIFY_MODEL": "0",
            "CHATTTS_REFINE_TEXT": "true",
            "CHATTTS_MODEL_DIR": "/m",
            "CHATTTS_THREADS": "3",
            "CHATTTS_CACHE_SIZE": "0",
        }
    )
    assert settings.port == 9000
    assert settings.verify_model is False
    assert settings.refine_text is True
    assert settings.model_dir == Path("/m")
    assert settings.torch_threads == 3
    assert settings.cache_size == 0


@pytest.mark.parametrize(
    "name,value",
    [
        ("CHATTTS_PORT", "eighty"),
        ("CHATTTS_PORT", "70000"),
        ("CHATTTS_VERIFY_MODEL", "maybe"),
        ("CHATTTS_MAX_CHARS", "0"),
        ("CHATTTS_THREADS", "-1"),
        ("CHATTTS_LOG_LEVEL", "LOUD"),
        ("CHATTTS_MAX_NEW_TOKENS", "0"),
        ("CHATTTS_KERNELS", "yes"),
        ("CHATTTS_INT8_PRODUCT", "avx512"),
    ],
)
def test_bad_values_are_refused_with_the_variable_named(name, value):
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({name: value})


def test_unknown_setting_is_reported(caplog):
    with caplog.at_level(logging.WARNING):
        Settings.from_env({"CHATTTS_CACHE_SIZES": "5"})
    assert "CHATTTS_CACHE_SIZES" in caplog.text


def test_readme_documents_every_setting_with_its_default_and_bounds():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    for variable, default, allowed, _ in Settings.documentation():
        row = next(
            (line for line in readme.splitlines() if line.startswith(f"| `{variable}`")), None
        )
        assert row is not None, f"{variable} missing from the README settings table"
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1] == f"`{default}`", f"{variable}: README default differs from {default}"
        expected = f"`{allowed}`" if allowed else ""
        assert cells[2] == expected, f"{variable}: README values {cells[2]} differ from {allowed}"


def test_bounds_are_declared_once_and_enforced():
    bounds = Settings.bounds("batch_wait_ms")
    assert (bounds.low, bounds.high) == (0, 10_000)
    Settings.from_env({"CHATTTS_BATCH_WAIT_MS": "10000"})
    with pytest.raises(SettingsError, match="CHATTTS_BATCH_WAIT_MS must be between 0 and 10000"):
        Settings.from_env({"CHATTTS_BATCH_WAIT_MS": "10001"})
    assert Settings.bounds("model_dir") is None


def test_every_chattts_variable_the_code_or_image_reads_is_a_setting():
    import re

    root = Path(__file__).resolve().parent.parent
    sources = [
        *root.joinpath("chattts_service").rglob("*.py"),
        root / "Dockerfile",
        root / "docker-compose.yml",
        root / "docker" / "entrypoint.sh",
        *root.joinpath("deploy").rglob("*.yaml"),
    ]
    read = set()
    for source in sources:
        read |= set(re.findall(r"\bCHATTTS_[A-Z0-9_]+\b", source.read_text(encoding="utf-8")))
    known = {variable for variable, *_ in Settings.documentation()}
    assert read - known == set(), "read but not a setting"


def test_docs_document_every_metric():
    from chattts_service.runtime.metrics import Metrics

    docs = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
    table = [
        line
        for line in docs.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `chatts_")
    ]
    from chattts_service.transport.intake import IntakeStats

    metrics = Metrics()
    metrics.connections.source = IntakeStats  # as the serving worker sets it
    names = {family.name for family in metrics.registry.collect()}
    assert "chatts_http_timeouts" in names
    assert names and all(name.startswith("chatts_") for name in names)
    for name in names:
        assert any(f"`{name}" in row for row in table), (
            f"{name} missing from the metrics table in docs/operations.md"
        )
