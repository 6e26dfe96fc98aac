"""A recording to ChatTTS's speaker prompt, as ``Chat.sample_audio_speaker`` makes it.

The DVAE's encoder path (mel features, the downsampling convolutions, the encoder and the
grouped FSQ quantiser) turns 24 kHz mono samples into integer codes ``[num_vq, frames]``; the
speaker prompt a request carries is those codes. The service decodes audio with the DVAE's
decoder path only, so this part is built from the same file on the first recording it is
asked to encode (the quantiser's library, ``vector_quantize_pytorch``, is imported then) and
kept for the next ones.
"""

from __future__ import annotations

import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch


class SampleEncoder:
    def __init__(self, dvae_file: Path, config):
        self.dvae_file, self.config = Path(dvae_file), config
        self._dvae: Any = None  # ChatTTS's DVAE (untyped), built on first use
        self._lock = threading.Lock()  # one encoding at a time; the first one builds the module

    @property
    def loaded(self) -> bool:
        return self._dvae is not None

    def _build(self):
        from ChatTTS.model import DVAE
        from safetensors.torch import load_file

        dvae = DVAE(
            decoder_config=asdict(self.config.dvae.decoder),
            encoder_config=asdict(self.config.dvae.encoder),
            vq_config=asdict(self.config.dvae.vq),
            dim=self.config.dvae.decoder.idim,
        )
        dvae.load_state_dict(load_file(str(self.dvae_file)), assign=True)
        # the decoder path is the service's own copy's job: drop this one's
        del dvae.decoder, dvae.out_conv
        return dvae.eval().requires_grad_(False)

    def __call__(self, samples: np.ndarray) -> torch.Tensor:
        """float32 mono samples at 24 kHz -> the codes ``[num_vq, frames]`` (int32), the
        tensor ``Chat.sample_audio_speaker`` encodes into its string."""
        with self._lock:
            if self._dvae is None:
                self._dvae = self._build()
            with torch.inference_mode():
                codes = self._dvae(torch.from_numpy(np.ascontiguousarray(samples)), "encode")
        return codes.squeeze(0).to(torch.int32)


def encode_prompt(codes: torch.Tensor) -> str:
    """ChatTTS's string form of a speaker prompt (``Speaker.encode_prompt``)."""
    from ChatTTS.model import Speaker

    return Speaker.encode_prompt(codes)


def decode_prompt(text: str) -> torch.Tensor:
    """The codes of a speaker prompt string (``Speaker.decode_prompt``)."""
    from ChatTTS.model import Speaker

    return Speaker.decode_prompt(text)
