"""The model files from the command line: fetch the real weights, or verify a directory.

    python -m chattts_service.tools.model download DIR [--endpoint URL]
    python -m chattts_service.tools.model verify DIR

``download`` does what the server does at start (``inference.download.ensure_model``) on a
machine that reaches the Hugging Face hub (``HF_ENDPOINT`` selects a mirror, ``HF_TOKEN`` is
honoured), for an air-gapped install to copy; ``verify`` checks every file against the
sha256 values the installed ChatTTS ships.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chattts_service.config import Settings
from chattts_service.inference.download import ensure_model
from chattts_service.inference.model_files import (
    HUB_REPO_ID,
    MODEL_FILES,
    ModelFilesError,
    verify,
)


def download(model_dir: Path, endpoint: str | None = None) -> Path:
    """Fetch the real weights from the hub into ``model_dir`` and verify them."""
    settings = Settings.from_env({}, model_dir=model_dir, verify_model=True, download="auto")
    ensure_model(settings, endpoint=endpoint)
    return model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chattts_service.tools.model",
        description="Download the ChatTTS weights into a directory, or verify one.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("download", help="fetch the weights from the Hugging Face hub")
    fetch.add_argument("model_dir", type=Path)
    fetch.add_argument("--endpoint", default=None, help="hub URL (default: $HF_ENDPOINT)")
    check = sub.add_parser("verify", help="check a directory against ChatTTS's checksums")
    check.add_argument("model_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "download":
            download(args.model_dir, endpoint=args.endpoint)
            print(f"downloaded and verified {HUB_REPO_ID} into {args.model_dir}")
        else:
            verify(args.model_dir)
            print(f"{args.model_dir}: all {len(MODEL_FILES)} files match")
    except ModelFilesError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
