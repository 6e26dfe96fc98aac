"""Where the model files live, how they are checked, and how the real ones are fetched.

The directory layout is the one ChatTTS itself expects (``asset/...``). Checksums come from
the ``sha256_map.json`` that the installed ChatTTS package ships, so a verified directory holds
exactly the weights that ChatTTS release was built for.

ChatTTS's own ``source="local"`` loader is never used: on a checksum mismatch it renames the
file and runs a downloaded binary.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from chattts_service.inference.architecture import ARCHITECTURE_FILE_NAME

HUB_REPO_ID = "2Noise/ChatTTS"
STAMP_NAME = ".verified.json"  # files verified, with the size and mtime they had then
# the same record for this process, for a volume the stamp cannot be written to (read-only):
# the server checks the model before loading and the loader again, without hashing it twice
_VERIFIED_HERE: dict[str, list] = {}
# architecture.json: this project's own description of a model of other shapes (the test
# models); the real repository has none, and the pattern then matches nothing
EXTRA_FILES = ("architecture.json",)
HUB_ALLOW_PATTERNS = ["asset/*", "asset/gpt/*", "asset/tokenizer/*", *EXTRA_FILES]

# Relative paths of every file the service loads, in ChatTTS's layout.
MODEL_FILES = (
    "asset/Vocos.safetensors",
    "asset/DVAE.safetensors",
    "asset/Decoder.safetensors",
    "asset/Embed.safetensors",
    "asset/gpt/config.json",
    "asset/gpt/model.safetensors",
    "asset/tokenizer/special_tokens_map.json",
    "asset/tokenizer/tokenizer_config.json",
    "asset/tokenizer/tokenizer.json",
)


class ModelFilesError(Exception):
    """The model directory is missing, incomplete or fails verification."""


@dataclass(frozen=True)
class ModelPaths:
    """Absolute paths of the files ``Chat._load`` takes, for one model directory."""

    base: Path

    def file(self, relative: str) -> Path:
        return self.base / relative

    @property
    def vocos(self) -> Path:
        return self.file("asset/Vocos.safetensors")

    @property
    def dvae(self) -> Path:
        return self.file("asset/DVAE.safetensors")

    @property
    def decoder(self) -> Path:
        return self.file("asset/Decoder.safetensors")

    @property
    def embed(self) -> Path:
        return self.file("asset/Embed.safetensors")

    @property
    def gpt(self) -> Path:
        return self.file("asset/gpt")

    @property
    def tokenizer(self) -> Path:
        return self.file("asset/tokenizer")

    @property
    def architecture(self) -> Path:
        return self.file(ARCHITECTURE_FILE_NAME)


def _map_key(relative: str) -> str:
    # ChatTTS's sha256_map.json names "asset/gpt/config.json" "sha256_asset_gpt_config_json".
    return "sha256_" + relative.replace("/", "_").replace(".", "_")


def shipped_checksums() -> dict[str, str]:
    """The sha256 of every model file, as shipped by the installed ChatTTS package."""
    import importlib.util

    spec = importlib.util.find_spec("ChatTTS")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesError("the ChatTTS package is not installed")
    map_path = Path(list(spec.submodule_search_locations)[0]) / "res" / "sha256_map.json"
    with open(map_path, encoding="utf-8") as handle:
        raw = json.load(handle)
    checksums = {}
    for relative in MODEL_FILES:
        key = _map_key(relative)
        if key not in raw:
            raise ModelFilesError(f"ChatTTS's checksum list has no entry for {relative}")
        checksums[relative] = raw[key]
    return checksums


def sha256_of(path: Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def check_present(model_dir: Path) -> ModelPaths:
    """Fail with the name of the first missing file; return the paths otherwise."""
    if not model_dir.is_dir():
        raise ModelFilesError(f"model directory {model_dir} does not exist")
    missing = [relative for relative in MODEL_FILES if not (model_dir / relative).is_file()]
    if missing:
        raise ModelFilesError(
            f"model directory {model_dir} is incomplete: missing {', '.join(missing)}"
        )
    return ModelPaths(model_dir)


def verify(model_dir: Path, checksums: dict[str, str] | None = None) -> None:
    """Check every file against its expected sha256 (ChatTTS's list unless ``checksums``);
    the error names each bad file."""
    check_present(model_dir)
    expected = shipped_checksums() if checksums is None else checksums
    bad = [
        f"{relative} (sha256 {actual[:12]}..., expected {expected[relative][:12]}...)"
        for relative, actual in _mismatches(model_dir, expected)
    ]
    if bad:
        raise ModelFilesError(
            f"model files in {model_dir} fail verification: {'; '.join(bad)}. "
            "Re-download them, or set CHATTTS_VERIFY_MODEL=0 for a self-built test model."
        )


def bad_files(model_dir: Path, checksums: dict[str, str] | None) -> list[str]:
    """Files missing, or (with checksums) whose sha256 differs."""
    missing = [relative for relative in MODEL_FILES if not (model_dir / relative).is_file()]
    if missing or checksums is None:
        return missing
    return [relative for relative, _ in _mismatches(model_dir, checksums)]


def _mismatches(model_dir: Path, checksums: dict[str, str]) -> list[tuple[str, str]]:
    """(file, its sha256) for each present file whose sha256 differs from ``checksums``. A file
    verified before and unchanged since (same size and modification time, recorded in
    ``.verified.json``, or in this process) is not hashed again: a restart does not read the
    whole model twice."""
    stamp_path = model_dir / STAMP_NAME
    try:
        stamp = json.loads(stamp_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stamp = {}
    mismatches, verified = [], {}
    for relative in MODEL_FILES:
        status = (model_dir / relative).stat()
        identity = [status.st_size, status.st_mtime_ns, checksums.get(relative)]
        here = str((model_dir / relative).resolve())
        if identity in (stamp.get(relative), _VERIFIED_HERE.get(here)):
            verified[relative] = identity
            continue
        actual = sha256_of(model_dir / relative)
        if actual == checksums.get(relative):
            verified[relative] = _VERIFIED_HERE[here] = identity
        else:
            mismatches.append((relative, actual))
    if verified != stamp:
        try:
            temporary = stamp_path.with_suffix(".tmp")
            temporary.write_text(json.dumps(verified), encoding="utf-8")
            os.replace(temporary, stamp_path)
        except OSError:  # a read-only volume: verify again next time
            pass
    return mismatches
