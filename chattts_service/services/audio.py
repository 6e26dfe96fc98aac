"""Encoding float audio for the wire: WAV, FLAC, MP3, Ogg Opus, AAC (ADTS), raw PCM and G.711.

Whole MP3, Opus and FLAC files go through ``soundfile`` (libsndfile, with LAME and libopus in
its wheels). Streams, AAC and G.711 (u-law and A-law, raw, as a phone line takes them) go
through ``StreamEncoder`` (PyAV: FFmpeg's LAME, libopus, AAC and G.711 encoders), which encodes
each chunk as it comes and hands back the bytes the muxer has written so far, never seeking
back. A WAV stream has an open-ended header and ends on a whole 4 KiB block.

Audio leaves at the model's rate (24 kHz, mono) unless a request asks for another
(``SAMPLE_RATES``; G.711 is 8 kHz unless asked): then FFmpeg's resampler (swresample, through
PyAV) converts the 16-bit samples first. It keeps its filter's state from chunk to chunk, so a
resampled stream holds the same samples as the resampled whole answer.
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
    "ulaw": ("audio/PCMU", None, None),  # G.711 u-law, raw (RFC 3551's name for it)
    "alaw": ("audio/PCMA", None, None),  # G.711 A-law, raw
}
STREAM_FORMATS = ("wav", "pcm", "mp3", "opus", "aac", "ulaw", "alaw")
# raw formats: their Content-Type says the rate and channels, as nothing in the bytes does
RAW_FORMATS = ("pcm", "ulaw", "alaw")
# format -> (FFmpeg muxer, FFmpeg encoder, bit rate or None) for StreamEncoder
ENCODERS = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 32_000),
    "aac": ("adts", "aac", 64_000),
    "ulaw": ("mulaw", "pcm_mulaw", None),
    "alaw": ("alaw", "pcm_alaw", None),
}
# the rates a request may ask for; the model's own is 24 kHz
SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
TELEPHONE_RATE = 8000  # G.711's, unless a request asks for another
# Opus codes these rates only (RFC 6716): 22.05 and 44.1 kHz are refused for it
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def output_rate(audio_format: str, asked: int | None, model_rate: int) -> int:
    """The rate a response leaves at: the one asked for, else G.711's 8 kHz for ulaw and
    alaw, else the model's."""
    if asked is not None:
        return asked
    return TELEPHONE_RATE if audio_format in ("ulaw", "alaw") else model_rate


OPEN_ENDED = 0xFFFFFFFF  # RIFF/data size of a WAV whose length is not known yet


def content_type(audio_format: str, sample_rate: int) -> str:
    if audio_format == "pcm":
        return f"audio/L16; rate={sample_rate}; channels=1"
    kind = FORMATS[audio_format][0]
    assert kind is not None  # every format but pcm names its type
    if audio_format in RAW_FORMATS:
        return f"{kind}; rate={sample_rate}; channels=1"
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


class Resampler:
    """16-bit mono PCM from one rate to another, chunk by chunk (FFmpeg's swresample): the
    bytes of ``__call__`` for every chunk, then ``finish()``, are the whole input's resampled.
    Equal rates pass the samples through untouched."""

    def __init__(self, from_rate: int, to_rate: int):
        self._from, self._to = from_rate, to_rate
        self._resampler: Any = None
        if from_rate != to_rate:
            import av

            self._av = av
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=to_rate)

    def __call__(self, pcm: bytes) -> bytes:
        if self._resampler is None or not pcm:
            return pcm
        samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
        frame = self._av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self._from
        return self._collect(self._resampler.resample(frame))

    def finish(self) -> bytes:
        if self._resampler is None:
            return b""
        return self._collect(self._resampler.resample(None))

    @staticmethod
    def _collect(frames: Any) -> bytes:
        return b"".join(frame.to_ndarray().astype("<i2").tobytes() for frame in frames)


def resample(pcm: bytes, from_rate: int, to_rate: int) -> bytes:
    """A whole answer's 16-bit samples at ``to_rate``."""
    resampler = Resampler(from_rate, to_rate)
    return resampler(pcm) + resampler.finish()


def encode(
    audio: np.ndarray, sample_rate: int, audio_format: str, out_rate: int | None = None
) -> bytes:
    """``audio`` (float, at ``sample_rate``) as a whole file of ``audio_format`` at
    ``out_rate`` (default: ``sample_rate``)."""
    rate = out_rate or sample_rate
    pcm = resample(to_pcm16(audio), sample_rate, rate)
    if audio_format == "wav":
        return wav_header(rate, len(pcm)) + pcm
    if audio_format == "pcm":
        return pcm
    if audio_format in ENCODERS and audio_format not in ("mp3", "opus"):  # not in libsndfile
        encoder = StreamEncoder(audio_format, rate)
        return encoder.encode(pcm) + encoder.finish()
    import soundfile

    _, container, subtype = FORMATS[audio_format]
    buffer = io.BytesIO()
    # the same 16-bit samples as WAV and PCM: a lossless format decodes to identical values
    samples = np.frombuffer(pcm, dtype="<i2")
    with soundfile.SoundFile(
        buffer, "w", samplerate=rate, channels=1, format=container, subtype=subtype
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
        if bit_rate is not None:
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
        # encoders take frames of a fixed size (1152 samples for MP3, 1024 AAC, 480 Opus at
        # 24 kHz); G.711 takes any (0), so 1024 at a time
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


class StreamWriter:
    """What turns a stream's 16-bit PCM chunks (at the model's rate) into the bytes of its
    format at its rate: ``encode(pcm)`` per chunk, ``finish()`` once at the end."""

    def __init__(self, writer: _RawWriter | StreamEncoder, resampler: Resampler):
        self._writer, self._resampler = writer, resampler

    def encode(self, pcm: bytes) -> bytes:
        return self._writer.encode(self._resampler(pcm))

    def finish(self) -> bytes:
        rest = self._resampler.finish()
        return (self._writer.encode(rest) if rest else b"") + self._writer.finish()


def stream_writer(audio_format: str, sample_rate: int, out_rate: int | None = None) -> StreamWriter:
    """A stream's writer: chunks at ``sample_rate`` in, ``audio_format`` at ``out_rate``
    (default: ``sample_rate``) out."""
    if audio_format not in STREAM_FORMATS:
        raise ValueError(f"{audio_format} cannot be streamed")
    rate = out_rate or sample_rate
    writer: _RawWriter | StreamEncoder
    if audio_format == "wav":
        writer = _RawWriter(wav_header(rate, None), WAV_STREAM_BLOCK)
    elif audio_format == "pcm":
        writer = _RawWriter()
    else:
        writer = StreamEncoder(audio_format, rate)
    return StreamWriter(writer, Resampler(sample_rate, rate))
