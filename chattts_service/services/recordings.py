"""Uploaded recordings (voice samples, consent recordings) read as 24 kHz mono samples.

PyAV (FFmpeg) decodes whatever container the upload is in (MP3, WAV, Ogg/Opus, AAC, FLAC,
WebM, MP4), frame by frame, resampled to the model's rate and mixed to mono as it goes.
Decoding stops as soon as the audio passes the length allowed, so a small compressed file that
would decode to hours costs no more memory than the limit's worth of samples.
"""

from __future__ import annotations

import io

import numpy as np

from chattts_service.domain.speech import SAMPLE_RATE

MAX_UPLOAD_BYTES = 10 * 2**20  # OpenAI's limit for samples and consent recordings
# A voice sample: enough speech for ChatTTS's speaker prompt, and no more (every request in the
# voice carries the sample's codes, about 47 positions a second, in its prompt)
MIN_SAMPLE_SECONDS, MAX_SAMPLE_SECONDS = 1.0, 15.0
MIN_CONSENT_SECONDS, MAX_CONSENT_SECONDS = 0.5, 60.0
MAX_TRANSCRIPT_CHARS = 500
# the content types OpenAI lists, the names browsers and FFmpeg give them, and unlabelled bytes
CONTENT_TYPES = {
    "audio/mpeg": "mp3",
    "audio/mp3": "mp3",
    "audio/wav": "wav",
    "audio/x-wav": "wav",
    "audio/wave": "wav",
    "audio/vnd.wave": "wav",
    "audio/ogg": "ogg",
    "application/ogg": "ogg",
    "audio/opus": "ogg",
    "audio/aac": "aac",
    "audio/x-aac": "aac",
    "audio/flac": "flac",
    "audio/x-flac": "flac",
    "audio/webm": "webm",
    "video/webm": "webm",
    "audio/mp4": "mp4",
    "audio/x-m4a": "mp4",
    "audio/m4a": "mp4",
    "video/mp4": "mp4",
    "application/octet-stream": "bin",
}
# samples quieter than this peak (about -54 dBFS) hold no voice to copy
SILENCE_PEAK = 0.002


class RecordingError(ValueError):
    """A recording that cannot be used; the message says why."""


class WrongContentType(RecordingError):
    pass


def extension_for(content_type: str | None) -> str:
    """The file extension an upload of ``content_type`` is kept under, or WrongContentType."""
    kind = (content_type or "application/octet-stream").split(";")[0].strip().lower()
    if kind not in CONTENT_TYPES:
        raise WrongContentType(
            f"a recording of type {kind!r} cannot be used; send mp3, wav, ogg/opus, aac, "
            "flac, webm or mp4 audio"
        )
    return CONTENT_TYPES[kind]


def read(data: bytes, field: str, max_seconds: float, min_seconds: float) -> np.ndarray:
    """The recording ``data`` as float32 mono samples at 24 kHz, or RecordingError saying
    what is wrong with it (named as the form ``field`` it came in)."""
    import av

    if not data:
        raise RecordingError(f"'{field}' is empty")
    if len(data) > MAX_UPLOAD_BYTES:
        raise RecordingError(f"'{field}' is larger than 10 MiB")
    limit = int(max_seconds * SAMPLE_RATE)
    pieces, total = [], 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise RecordingError(f"'{field}' holds no audio")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    samples = out.to_ndarray().reshape(-1)
                    pieces.append(samples)
                    total += len(samples)
                if total > limit:
                    raise RecordingError(
                        f"'{field}' is longer than {max_seconds:g} s; a voice needs a few "
                        f"seconds of clear speech (at most {max_seconds:g} s)"
                    )
            for out in resampler.resample(None):
                pieces.append(out.to_ndarray().reshape(-1))
                total += len(pieces[-1])
    except RecordingError:
        raise
    except (av.FFmpegError, ValueError, IndexError, OSError):
        raise RecordingError(f"'{field}' is not audio this server can decode") from None
    if total > limit:
        raise RecordingError(f"'{field}' is longer than {max_seconds:g} s")
    audio = np.concatenate(pieces).astype(np.float32, copy=False) if pieces else np.zeros(0)
    if len(audio) < min_seconds * SAMPLE_RATE:
        raise RecordingError(
            f"'{field}' holds {len(audio) / SAMPLE_RATE:.2f} s of audio; at least "
            f"{min_seconds:g} s is needed"
        )
    if not np.isfinite(audio).all() or float(np.abs(audio).max()) < SILENCE_PEAK:
        raise RecordingError(f"'{field}' is silent")
    return np.clip(audio, -1.0, 1.0)
