"""Encoding float audio for the wire: WAV, FLAC, MP3, Ogg Opus and raw PCM.

Compressed formats go through ``soundfile`` (libsndfile, with LAME/mpg123 and libopus in the
wheels it ships). Every format carries the model's own rate (24 kHz, mono): Opus supports
24 kHz natively, so nothing is resampled. Streams are WAV with an open-ended header, or raw PCM.
"""

from __future__ import annotations

import io
import struct

import numpy as np

# format -> (Content-Type, soundfile container, soundfile subtype)
FORMATS = {
    "mp3": ("audio/mpeg", "MP3", "MPEG_LAYER_III"),
    "opus": ("audio/ogg; codecs=opus", "OGG", "OPUS"),
    "flac": ("audio/flac", "FLAC", "PCM_16"),
    "wav": ("audio/wav", "WAV", "PCM_16"),
    "pcm": (None, None, None),  # raw signed 16-bit little-endian, mono
}
STREAM_FORMATS = ("wav", "pcm")
OPEN_ENDED = 0xFFFFFFFF  # RIFF/data size of a WAV whose length is not known yet


def content_type(audio_format: str, sample_rate: int) -> str:
    if audio_format == "pcm":
        return f"audio/L16; rate={sample_rate}; channels=1"
    return FORMATS[audio_format][0]


def to_pcm16(audio: np.ndarray) -> bytes:
    """Samples outside [-1, 1] are clipped, not wrapped."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte PCM WAV header; ``data_bytes=None`` marks a stream of unknown length."""
    data = OPEN_ENDED if data_bytes is None else data_bytes
    riff = OPEN_ENDED if data_bytes is None else 36 + data_bytes
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        riff,
        b"WAVE",
        b"fmt ",
        16,
        1,
        1,
        sample_rate,
        sample_rate * 2,
        2,
        16,
        b"data",
        data,
    )


def to_wav(audio: np.ndarray, sample_rate: int) -> bytes:
    """Mono 16-bit PCM WAV."""
    pcm = to_pcm16(audio)
    return wav_header(sample_rate, len(pcm)) + pcm


def encode(audio: np.ndarray, sample_rate: int, audio_format: str) -> bytes:
    if audio_format == "wav":
        return to_wav(audio, sample_rate)
    if audio_format == "pcm":
        return to_pcm16(audio)
    import soundfile

    _, container, subtype = FORMATS[audio_format]
    buffer = io.BytesIO()
    # the same 16-bit samples as WAV and PCM: a lossless format decodes to identical values
    samples = np.frombuffer(to_pcm16(audio), dtype="<i2")
    with soundfile.SoundFile(
        buffer, "w", samplerate=sample_rate, channels=1, format=container, subtype=subtype
    ) as writer:
        writer.write(samples)
    return buffer.getvalue()


def silence(seconds: float, sample_rate: int) -> np.ndarray:
    return np.zeros(int(round(seconds * sample_rate)), dtype=np.float32)
