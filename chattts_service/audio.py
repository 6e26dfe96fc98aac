"""Encoding float audio for the wire."""

from __future__ import annotations

import io
import wave

import numpy as np


def to_wav(audio: np.ndarray, sample_rate: int) -> bytes:
    """Mono 16-bit PCM WAV; samples outside [-1, 1] are clipped, not wrapped."""
    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(sample_rate)
        writer.writeframes(pcm.tobytes())
    return buffer.getvalue()
