"""ChatTTS's speaker embedding strings (``spk_emb``: float16 values, LZMA2, base16384), and
the digests that name an embedding or a recording's speaker prompt in the cache key."""

from __future__ import annotations

import hashlib
import lzma
from typing import Any

import numpy as np

from chattts_service.domain.voices import (
    MAX_EMBEDDING_CHARS,
    NotAnEmbedding,
    SpeakerSample,
    VoiceError,
)


def decode_embedding(text: str, dim: int) -> Any:
    """A ChatTTS speaker embedding string -> float32 tensor [dim], or VoiceError."""
    import pybase16384 as b14
    import torch

    if not isinstance(text, str) or not text:
        raise VoiceError("'embedding' must be a non-empty string")
    if len(text) > MAX_EMBEDDING_CHARS:
        raise VoiceError(f"'embedding' is longer than {MAX_EMBEDDING_CHARS} characters")
    try:
        raw = lzma.decompress(
            b14.decode_from_string(text),
            format=lzma.FORMAT_RAW,
            filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}],
        )
    except Exception:
        raise NotAnEmbedding("'embedding' is not a ChatTTS speaker embedding string") from None
    if len(raw) != dim * 2:
        raise NotAnEmbedding(
            f"'embedding' has {len(raw) // 2} values; this model's voices have {dim}"
        )
    values = np.frombuffer(raw, dtype=np.float16).astype(np.float32)
    if not np.isfinite(values).all():
        raise NotAnEmbedding("'embedding' holds non-finite values")
    return torch.from_numpy(values.copy())


def encode_embedding(embedding: Any) -> str:
    """The inverse of ``decode_embedding`` (ChatTTS's own string format)."""
    import pybase16384 as b14

    raw = embedding.detach().to("cpu").numpy().astype(np.float16).tobytes()
    packed = lzma.compress(
        raw,
        format=lzma.FORMAT_RAW,
        filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}],
    )
    return str(b14.encode_to_string(packed))


def digest(embedding: Any) -> str:
    return hashlib.sha256(embedding.numpy().astype("<f4").tobytes()).hexdigest()[:32]


def sample_digest(sample: SpeakerSample) -> str:
    data = sample.codes.numpy().astype("<u2").tobytes() + sample.transcript.encode("utf-8")
    return hashlib.sha256(data).hexdigest()[:32]
