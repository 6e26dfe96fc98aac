"""Encoding float audio for the wire: WAV, FLAC, MP3, Ogg Opus, AAC (ADTS) and raw PCM.

Whole MP3, Opus and FLAC files go through ``soundfile`` (libsndfile, with LAME and libopus in
its wheels). Streams, and AAC, go through ``StreamEncoder`` (PyAV: FFmpeg's LAME, libopus and
AAC encoders), which encodes each chunk as it comes and hands back the bytes the muxer has
written so far, never seeking back. Every format carries the model's own rate (24 kHz, mono):
nothing is resampled. A WAV stream has an open-ended header and ends on a whole 4 KiB block.
"""

from __future__ import annotations

import io
import struct
from typing import Any, cast

import numpy as np

# format -> (Content-Type, soundfile container, soundfile subtype)
FORMATS = {
    "mp3": ("audio/mpeg", "MP3", "MPEG_LAYER_III"),
    "opus": ("audio/ogg; codecs=opus", "OGG", "OPUS"),
    "flac": ("audio/flac", "FLAC", "PCM_16"),
    "wav": ("audio/wav", "WAV", "PCM_16"),
    "pcm": (None, None, None),  # raw signed 16-bit little-endian, mono
    "aac": ("audio/aac", None, None),  # ADTS, as OpenAI sends it
}
STREAM_FORMATS = ("wav", "pcm", "mp3", "opus", "aac")
# format -> (FFmpeg muxer, FFmpeg encoder, bit rate) for StreamEncoder
ENCODERS = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 32_000),
    "aac": ("adts", "aac", 64_000),
}
OPEN_ENDED = 0xFFFFFFFF  # RIFF/data size of a WAV whose length is not known yet


def content_type(audio_format: str, sample_rate: int) -> str:
    if audio_format == "pcm":
        return f"audio/L16; rate={sample_rate}; channels=1"
    kind = FORMATS[audio_format][0]
    assert kind is not None  # every format but pcm names its type
    return kind


def to_pcm16(audio: np.ndarray) -> bytes:
    """Samples outside [-1, 1] are clipped, not wrapped."""
    return bytes((np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes())


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
    if audio_format == "aac":  # libsndfile has no AAC
        encoder = StreamEncoder(audio_format, sample_rate)
        return encoder.encode(to_pcm16(audio)) + encoder.finish()
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


class _Sink:
    """Where the muxer writes: not seekable, so it never goes back over bytes already sent."""

    def __init__(self) -> None:
        self.pending = bytearray()

    def write(self, data: bytes) -> int:
        self.pending += data
        return len(data)

    def seekable(self) -> bool:
        return False

    def take(self) -> bytes:
        data, self.pending = bytes(self.pending), bytearray()
        return data


class StreamEncoder:
    """MP3, Ogg Opus or AAC (ADTS) encoded chunk by chunk: ``encode(pcm)`` (16-bit samples, as
    ``to_pcm16`` makes them) returns the bytes ready so far (possibly none), ``finish()`` the
    rest. The concatenation is one valid file."""

    def __init__(self, audio_format: str, sample_rate: int):
        import av

        muxer, codec, bit_rate = ENCODERS[audio_format]
        self._av = av
        self._sink = _Sink()
        # Ogg holds pages back for a second by default: flush one every 100 ms instead
        options = {"page_duration": "100000"} if muxer == "ogg" else {}
        self._container = av.open(self._sink, mode="w", format=muxer, options=options)
        # PyAV's audio stream (typed as any of its stream kinds)
        stream = self._container.add_stream(codec, rate=sample_rate, layout="mono")
        self._stream: Any = cast(Any, stream)
        self._stream.bit_rate = bit_rate
        self._rate = sample_rate
        self._fifo = av.AudioFifo()
        self._pts = 0

    def encode(self, pcm: bytes) -> bytes:
        if pcm:
            samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
            frame = self._av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate = self._rate
            self._fifo.write(frame)
        self._drain(final=False)
        return self._sink.take()

    def finish(self) -> bytes:
        self._drain(final=True)
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()

    def _drain(self, final: bool) -> None:
        # encoders take frames of a fixed size (1152 samples for MP3, 1024 AAC, 480 Opus)
        size = self._stream.codec_context.frame_size or 1024
        while self._fifo.samples >= size or (final and self._fifo.samples):
            frame: Any = self._fifo.read(min(size, self._fifo.samples))
            frame.pts = self._pts
            self._pts += frame.samples
            for packet in self._stream.encode(frame):
                self._container.mux(packet)


# A WAV stream's data ends on a multiple of this many bytes (2,048 samples, 85 ms): FFmpeg's
# WAV reader asks for 4,096-byte packets up to the size a header declares, and flags a short
# last packet of an open-ended file as corrupt (``ffmpeg -xerror`` stops on it)
WAV_STREAM_BLOCK = 4096


class _RawWriter:
    """PCM as it comes; a WAV stream is the same after a header of unknown length, with
    silence after its last sample up to a whole ``block`` of bytes (0 for none)."""

    def __init__(self, header: bytes = b"", block: int = 0):
        self._header, self._block, self._sent = header, block, 0

    def encode(self, pcm: bytes) -> bytes:
        header, self._header = self._header, b""
        self._sent += len(pcm)
        return header + pcm

    def finish(self) -> bytes:
        header, self._header = self._header, b""
        padding = -self._sent % self._block if self._block else 0
        return header + bytes(padding)


# what turns a stream's PCM chunks into the bytes of its format
StreamWriter = _RawWriter | StreamEncoder


def stream_writer(audio_format: str, sample_rate: int) -> StreamWriter:
    """What turns a stream's 16-bit PCM chunks into the bytes of ``audio_format``:
    ``encode(pcm)`` per chunk, ``finish()`` once at the end."""
    if audio_format not in STREAM_FORMATS:
        raise ValueError(f"{audio_format} cannot be streamed")
    if audio_format == "wav":
        return _RawWriter(wav_header(sample_rate, None), WAV_STREAM_BLOCK)
    if audio_format == "pcm":
        return _RawWriter()
    return StreamEncoder(audio_format, sample_rate)
