"""Make the model directory complete before loading: fetch what is missing or corrupt.

With ``CHATTTS_DOWNLOAD=auto`` (the default) a directory that is empty, incomplete or fails
verification is filled from the Hugging Face hub (``HF_ENDPOINT``, ``HF_TOKEN``) by
``huggingface_hub``: each file is written under a temporary name and renamed when whole, and a
download that was killed resumes from where it stopped, so a directory never looks complete
before it is. Files are then checked against the expected sha256 values; a corrupt one is
deleted and fetched again. Replicas sharing one volume take a file lock: one downloads, the
others wait and find the files there. ``CHATTTS_DOWNLOAD=never`` (air-gapped sites) keeps the
clear error of an incomplete directory.

Progress (bytes done and total) is kept in a ``DownloadProgress`` for ``/readyz`` and
``/status``, and logged every few seconds.

The hub client lists the files, builds the URLs and headers (``HF_TOKEN``); the bytes are
fetched here because what this needs is what ``snapshot_download`` (huggingface_hub 2.4) does
not do: it writes each file to a temporary named for its process and deletes it when the
download fails (huggingface_hub PR 4228), so a killed start begins the 1.1 GB again (and a
SIGKILL leaves the partial behind for good), and it reports a file's progress once per 10 MiB.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from chattts_service.config import Settings
from chattts_service.inference import model_files
from chattts_service.inference.model_files import MODEL_FILES, ModelFilesError, bad_files

log = logging.getLogger(__name__)

LOCK_NAME = ".download.lock"
PARTIAL_DIR = Path(".partial")  # files being fetched, renamed into place when whole
CHUNK_BYTES = 1 << 16
PROGRESS_LOG_SECONDS = 5.0


class DownloadFailed(ModelFilesError):
    """The hub could not be reached or refused; worth trying again later."""


class DownloadProgress:
    """What a download has done so far, read by other threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_done = 0
        self.bytes_total: int | None = None
        self.error: str | None = None
        self.retry_at: float | None = None

    def snapshot(self) -> dict:
        with self._lock:
            body: dict[str, object] = {
                "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total,
            }
            if self.error:
                body["error"] = self.error
            if self.retry_at is not None:
                body["retry_in_seconds"] = max(0, round(self.retry_at - time.monotonic()))
            return body

    def update(self, **values) -> None:
        with self._lock:
            for name, value in values.items():
                setattr(self, name, value)


def expected_checksums(settings: Settings) -> dict[str, str] | None:
    """The sha256 values the files must have: a JSON file of ``{relative path: sha256}``
    (``CHATTTS_MODEL_CHECKSUMS``, for a model of another revision), ChatTTS's own list, or none
    when ``CHATTTS_VERIFY_MODEL=0``."""
    if settings.model_checksums:
        try:
            with open(settings.model_checksums, encoding="utf-8") as handle:
                return json.load(handle)
        except (OSError, ValueError) as error:
            raise ModelFilesError(
                f"CHATTTS_MODEL_CHECKSUMS={settings.model_checksums}: {error}"
            ) from None
    return model_files.shipped_checksums() if settings.verify_model else None


def ensure_model(
    settings: Settings,
    progress: DownloadProgress | None = None,
    on_download=None,
    endpoint: str | None = None,
) -> None:
    """Return once ``settings.model_dir`` holds every file (verified where checksums are
    known); download what is missing or bad, or raise ``ModelFilesError`` (``DownloadFailed``
    when trying again later may help). ``on_download()`` is called before a download starts;
    ``endpoint`` overrides ``HF_ENDPOINT``."""
    model_dir = Path(settings.model_dir)
    checksums = expected_checksums(settings)
    if settings.download == "never":
        model_files.check_present(model_dir)  # names what is missing
        if checksums is not None:
            model_files.verify(model_dir, checksums)  # or what is bad
        return
    if not bad_files(model_dir, checksums):
        return
    model_dir.mkdir(parents=True, exist_ok=True)
    progress = progress or DownloadProgress()
    if on_download is not None:
        on_download()
    with _exclusive(model_dir / LOCK_NAME):
        # another replica may have fetched them while this one waited for the lock
        for attempt in range(2):
            bad = bad_files(model_dir, checksums)
            if not bad:
                return
            if attempt:
                log.warning("fetching again the files that failed verification: %s", bad)
            for relative in bad:
                if (model_dir / relative).is_file():  # present but corrupt; a partial resumes
                    _forget(model_dir, relative)
            _fetch(model_dir, progress, hub_endpoint(endpoint))
        bad = bad_files(model_dir, checksums)
        if bad:
            raise ModelFilesError(
                f"the files fetched from {hub_endpoint(endpoint)} fail verification twice: "
                f"{', '.join(bad)}. The hub holds other weights than this ChatTTS release "
                "expects; set CHATTTS_MODEL_CHECKSUMS, or copy verified files into "
                f"{model_dir}."
            )


def hub_endpoint(endpoint: str | None = None) -> str:
    return endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def _forget(model_dir: Path, relative: str) -> None:
    """Set a file that fails verification aside (never deleted: it may be someone's own
    weights, for which CHATTTS_VERIFY_MODEL=0 or CHATTTS_MODEL_CHECKSUMS is the setting), so
    it is fetched whole again."""
    aside = model_dir / PARTIAL_DIR / f"{relative}.corrupt"
    aside.parent.mkdir(parents=True, exist_ok=True)
    os.replace(model_dir / relative, aside)
    (model_dir / PARTIAL_DIR / f"{relative}.part").unlink(missing_ok=True)
    log.warning("%s fails verification: moved to %s, fetching it again", relative, aside)


def _fetch(model_dir: Path, progress: DownloadProgress, hub: str) -> None:
    """Fetch every model file that is not in place, one after the other."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    try:
        tree = HfApi(endpoint=hub).list_repo_tree(model_files.HUB_REPO_ID, recursive=True)
        sizes = {
            entry.path: entry.size
            for entry in tree
            if isinstance(entry, RepoFile)
            and entry.size is not None
            and (entry.path in MODEL_FILES or entry.path in model_files.EXTRA_FILES)
        }
        missing = [relative for relative in MODEL_FILES if relative not in sizes]
        if missing:
            raise ModelFilesError(
                f"{hub} has no {', '.join(missing)} in {model_files.HUB_REPO_ID}; point "
                f"HF_ENDPOINT at a mirror that has, or copy the files into {model_dir}"
            )
        wanted = [relative for relative in sizes if not (model_dir / relative).is_file()]
        done = sum(size for relative, size in sizes.items() if relative not in wanted)
        progress.update(
            bytes_done=done,
            bytes_total=sum(sizes.values()),
            error=None,
            retry_at=None,
        )
        log.info(
            "downloading %d files of %s from %s into %s (%.1f MB to fetch)",
            len(wanted),
            model_files.HUB_REPO_ID,
            hub,
            model_dir,
            sum(sizes[r] for r in wanted) / 1e6,
        )
        reporter = _Reporter(progress)
        for relative in wanted:
            _fetch_file(hub, relative, sizes[relative], model_dir, reporter)
    except ModelFilesError:
        raise
    except Exception as error:  # OSError (a full disk...), HTTP errors, the hub client's types
        what = f"{error.__class__.__name__}: {error}"
        raise DownloadFailed(_advice(hub, model_dir, what)) from None


def _fetch_file(hub: str, relative: str, size: int, model_dir: Path, reporter) -> None:
    """One file, written to ``<file>.part`` beside the others' partials and renamed when it is
    whole. A partial left by a killed process is resumed with an HTTP Range request."""
    import requests
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    part = model_dir / PARTIAL_DIR / f"{relative}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have > size:  # not the file the hub holds now
        part.unlink()
        have = 0
    headers = build_hf_headers()  # HF_TOKEN, user agent
    if have:
        headers["Range"] = f"bytes={have}-"
    url = hf_hub_url(model_files.HUB_REPO_ID, relative, endpoint=hub)
    with requests.get(url, headers=headers, stream=True, timeout=(10, 60)) as answer:
        if have and answer.status_code == 200:  # the server sent it all: start over
            have = 0
        elif answer.status_code not in (200, 206):
            raise DownloadFailed(
                f"{url} answered {answer.status_code} {answer.reason}"
                + (" (HF_TOKEN missing or wrong?)" if answer.status_code in (401, 403) else "")
            )
        reporter.add(have)
        with open(part, "ab" if have else "wb") as out:
            for chunk in answer.iter_content(CHUNK_BYTES):
                out.write(chunk)
                reporter.add(len(chunk))
    if part.stat().st_size != size:
        raise DownloadFailed(f"{relative}: got {part.stat().st_size} bytes of {size}")
    target = model_dir / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, target)


class _Reporter:
    """Adds fetched bytes to the progress and logs a line every few seconds."""

    def __init__(self, progress: DownloadProgress):
        self.progress = progress
        self.last_log = time.monotonic()

    def add(self, count: int) -> None:
        progress = self.progress
        progress.update(bytes_done=progress.bytes_done + count)
        if time.monotonic() - self.last_log >= PROGRESS_LOG_SECONDS:
            self.last_log = time.monotonic()
            total = progress.bytes_total or 0
            log.info(
                "downloading the model: %.1f of %.1f MB (%.0f%%)",
                progress.bytes_done / 1e6,
                total / 1e6,
                100.0 * progress.bytes_done / total if total else 0.0,
            )


def _advice(hub: str, model_dir: Path, what: str) -> str:
    return (
        f"could not download {model_files.HUB_REPO_ID} from {hub}: {what}. Either point "
        f"HF_ENDPOINT at a reachable mirror, or copy the model files into {model_dir} "
        "(python -m chattts_service.tools.model download DIR on a machine that "
        "reaches the hub)"
    )


@contextmanager
def _exclusive(lock_path: Path):
    """One downloader per model directory, across processes (replicas on one volume)."""
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is downloading into %s; waiting for it", lock_path.parent)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
