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
        self._stages = _stages(decoder, vocos)
        self._head_radius = _head_radius(vocos)
        self._hop = vocos.head.istft.hop_length

    def __call__(self, hiddens: torch.Tensor, dtype: str | None = None) -> np.ndarray:
        """[steps, hidden] -> float32 samples in [-1, 1]."""
        bf16 = (dtype or self.dtype) == "bf16"
        with torch.inference_mode():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                mel = self.decoder(hiddens.T[None].contiguous())
                features = self.vocos.backbone(mel.float())
            audio = self.vocos.head(features.float())[0]
        return _samples(audio)

    def span(self, hiddens: torch.Tensor, first: int, last: int | None = None) -> np.ndarray:
        """``self(hiddens)``'s samples of steps [first, last) (to the end when ``last`` is
        None), the same bits, computed from less: each stage of the decoder and the vocoder
        runs only on the frames the stages after it still read (a receptive field shrinks stage
        by stage), where ``self`` runs every stage on every frame. A streamed chunk keeps a few
        steps of a window that holds its context on both sides."""
        if self._stages is None:  # a decoder of another shape: decode the whole window
            audio = self(hiddens)
            end = None if last is None else last * 2 * self._hop
            return audio[first * 2 * self._hop : end]
        with torch.inference_mode():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bf16"):
                x = _frames(hiddens.T[None].contiguous())
                total = x.shape[-1]
                keep_lo, keep_hi = 2 * first, total if last is None else 2 * last
                reach = self._head_radius + sum(radius for _, radius in self._stages)
                offset = 0  # the frame x starts at
                for stage, radius in self._stages:
                    lo, hi = max(0, keep_lo - reach), min(total, keep_hi + reach)
                    x, offset = x[..., lo - offset : hi - offset], lo
                    x = stage(x)
                    reach -= radius
            lo, hi = max(0, keep_lo - reach), min(total, keep_hi + reach)
            features = x[..., lo - offset : hi - offset].transpose(1, 2)
            audio = self.vocos.head(features.float())[0]
        start = (keep_lo - lo) * self._hop
        end = None if last is None else start + (keep_hi - keep_lo) * self._hop
        return _samples(audio[start:end])


def _samples(audio: torch.Tensor) -> np.ndarray:
    return np.clip(audio.numpy().astype(np.float32, copy=False), -1.0, 1.0)


def _conv_radius(module) -> int:
    """How many frames on each side of an output frame its convolutions read."""
    return sum(
        conv.dilation[0] * (conv.kernel_size[0] - 1) // 2
        for conv in module.modules()
        if isinstance(conv, torch.nn.Conv1d)
    )


def _head_radius(vocos) -> int:
    """How many frames on each side of an output sample's frame the inverse STFT reads."""
    istft = vocos.head.istft
    return istft.win_length // istft.hop_length // 2


def _frames(x: torch.Tensor) -> torch.Tensor:
    """ChatTTS's DVAE.forward: each step's hidden state is two mel frames' features."""
    return x.view(x.size(0), 2, x.size(1) // 2, x.size(2)).permute(0, 2, 3, 1).flatten(2)


def _stages(decoder, vocos):
    """The decoder's and the backbone's forward passes (ChatTTS's ``DVAE.forward`` decode path,
    ``DVAEDecoder.forward``, Vocos' ``VocosBackbone.forward``) as steps, each with how many
    frames either side it reads, on [batch, channels, frames] tensors (the head takes the last
    one transposed, as the backbone returns it); None for modules of another shape."""
    dvae, backbone = decoder.decoder, vocos.backbone
    if getattr(decoder, "vq_layer", None) is not None or getattr(backbone, "adanorm", True):
        return None

    def out(y):
        y = decoder.out_conv(y)
        return torch.mul(y, decoder.coef, out=y)

    def norm(y):
        return backbone.norm(y.transpose(1, 2)).transpose(1, 2)

    def final(y):
        return backbone.final_layer_norm(y.transpose(1, 2)).transpose(1, 2)

    stages = [(dvae.conv_in, _conv_radius(dvae.conv_in))]
    stages += [(lambda y, b=b: b(y, None), _conv_radius(b)) for b in dvae.decoder_block]
    stages += [(dvae.conv_out, _conv_radius(dvae.conv_out)), (out, _conv_radius(decoder.out_conv))]
    stages += [(lambda y: backbone.embed(y.float()), _conv_radius(backbone.embed)), (norm, 0)]
    stages += [
        (lambda y, b=b: b(y, cond_embedding_id=None), _conv_radius(b)) for b in backbone.convnext
    ]
    stages.append((final, 0))
    return stages


def decoder_context_steps(decoder, vocos) -> int:
    """How many GPT steps on each side of an audio sample can change it: the receptive field of
    the decoder's and the vocoder's convolutions plus the inverse STFT's window, in mel frames
    (two per step). A chunk decoded with this much context on both sides is the same as that
    stretch of a decode of the whole."""
    frames = _conv_radius(decoder) + _conv_radius(vocos.backbone) + _head_radius(vocos)
    return -(-frames // 2)
