"""GPT hidden states to a waveform, through ChatTTS's decoder and the Vocos vocoder."""

from __future__ import annotations

import numpy as np
import torch


class AudioDecoder:
    """The decoder and the vocoder's ConvNeXt backbone may run in bf16 (on CPUs with native
    bf16 dot products; the waveform difference is in docs/benchmarks.md); the vocoder's head
    (its complex inverse STFT) stays in fp32."""

    def __init__(self, decoder, vocos, dtype: str):
        self.decoder, self.vocos, self.dtype = decoder, vocos, dtype
        self.context_steps = decoder_context_steps(decoder, vocos)

    def __call__(self, hiddens: torch.Tensor, dtype: str | None = None) -> np.ndarray:
        """[steps, hidden] -> float32 samples in [-1, 1]."""
        bf16 = (dtype or self.dtype) == "bf16"
        with torch.inference_mode():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                mel = self.decoder(hiddens.T[None].contiguous())
                features = self.vocos.backbone(mel.float())
            audio = self.vocos.head(features.float())[0]
        return np.clip(audio.numpy().astype(np.float32, copy=False), -1.0, 1.0)


def decoder_context_steps(decoder, vocos) -> int:
    """How many GPT steps on each side of an audio sample can change it: the receptive field of
    the decoder's and the vocoder's convolutions plus the inverse STFT's window, in mel frames
    (two per step). A chunk decoded with this much context on both sides is the same as that
    stretch of a decode of the whole."""
    frames = 0
    for module in (decoder, vocos.backbone):
        for conv in module.modules():
            if isinstance(conv, torch.nn.Conv1d):
                frames += conv.dilation[0] * (conv.kernel_size[0] - 1) // 2
    head = vocos.head
    frames += head.istft.win_length // head.istft.hop_length // 2
    return -(-frames // 2)
