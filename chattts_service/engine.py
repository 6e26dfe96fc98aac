"""The model: loaded once per process, one inference at a time, no HTTP in sight.

ChatTTS's ``Chat.infer`` is not called: it mutates the parameter objects it is given, splits and
re-synthesises text, deletes quiet samples from the output, and its ``source="local"`` loader
runs a downloaded binary. The engine drives ChatTTS's own modules instead (normaliser, optional
text refinement, code generation, decoder, vocoder) with fresh parameters for every request.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import model_files
from .architecture import config_from_architecture, read_architecture
from .config import Settings

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
STEPS_PER_SECOND = SAMPLE_RATE / 512  # one GPT step -> 2 mel frames of hop 256

WARMUP_TEXTS = ("你好，欢迎使用语音合成服务。", "Hello, this is a warm-up sentence.")
WARMUP_MAX_STEPS = 24


class EngineError(Exception):
    """Inference could not produce audio for a request."""


class NothingToSay(EngineError):
    """After text normalisation nothing speakable is left."""


@dataclass(frozen=True)
class SynthesisRequest:
    """Everything that changes the audio. The cache key is built from these fields."""

    text: str
    seed: int
    refine_text: bool = False


@dataclass(frozen=True)
class Synthesis:
    audio: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int
    steps: int
    spoken_text: str

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sample_rate


class Engine:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._lock = threading.Lock()
        self._chat = None
        self.model_name = "unloaded"
        self.load_seconds: float | None = None

    # -- loading -------------------------------------------------------------------------------

    def load(self) -> None:
        """Verify (unless disabled) and load the model files; raise ModelFilesError when bad."""
        import torch

        _quiet_library_chatter()
        started = time.perf_counter()
        model_dir = Path(self.settings.model_dir)
        paths = model_files.check_present(model_dir)
        if self.settings.verify_model:
            model_files.verify(model_dir)
        architecture = read_architecture(paths.architecture)

        torch.set_num_threads(self.settings.torch_threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set once in this process
            pass

        from ChatTTS import Chat

        chat = Chat(logging.getLogger("ChatTTS"))
        chat.config = config_from_architecture(architecture)
        loaded = chat._load(
            vocos_ckpt_path=str(paths.vocos),
            dvae_ckpt_path=str(paths.dvae),
            gpt_ckpt_path=str(paths.gpt),
            embed_path=str(paths.embed),
            decoder_ckpt_path=str(paths.decoder),
            tokenizer_path=str(paths.tokenizer),
            device=torch.device("cpu"),
        )
        if not loaded:
            raise model_files.ModelFilesError(f"ChatTTS could not load the model in {model_dir}")
        if chat.tokenizer.len != chat.config.gpt.num_text_tokens:
            raise model_files.ModelFilesError(
                f"tokenizer in {paths.tokenizer} has {chat.tokenizer.len} tokens, "
                f"the model expects {chat.config.gpt.num_text_tokens}"
            )
        self._chat = chat
        self.model_name = (architecture or {}).get("name", "chattts")
        self.load_seconds = time.perf_counter() - started
        log.info("model %s loaded from %s in %.2fs (%d torch threads)", self.model_name,
                 model_dir, self.load_seconds, self.settings.torch_threads)

    @property
    def loaded(self) -> bool:
        return self._chat is not None

    # -- inference -----------------------------------------------------------------------------

    def speaker_embedding(self, seed: int):
        """A reproducible voice for ``seed``, drawn without touching the global RNG."""
        import torch

        speaker = self._chat.speaker
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(speaker.dim, generator=generator, dtype=torch.float32)
        return noise * speaker.std.float() + speaker.mean.float()

    def synthesize(self, request: SynthesisRequest, max_steps: int | None = None) -> Synthesis:
        if self._chat is None:
            raise EngineError("model is not loaded")
        with self._lock:
            return self._synthesize_locked(request, max_steps or self.settings.max_new_tokens)

    def _synthesize_locked(self, request: SynthesisRequest, max_steps: int) -> Synthesis:
        import torch

        chat = self._chat
        text = chat.normalizer(request.text, do_text_normalization=True,
                               do_homophone_replacement=True)
        if not _speakable(text):
            raise NothingToSay("text has nothing speakable after normalisation")

        with torch.inference_mode():
            if request.refine_text:
                text = self._refine(text, request.seed)
                if not _speakable(text):
                    raise NothingToSay("text has nothing speakable after refinement")

            params = chat.InferCodeParams(
                spk_emb=self.speaker_embedding(request.seed),
                manual_seed=request.seed,
                max_new_token=max_steps,
                show_tqdm=False,
            )
            result = next(chat._infer_code([text], False, chat.device, True, params))
            hiddens = result.hiddens
            steps = int(hiddens[0].shape[0]) if hiddens else 0
            if steps == 0:
                raise EngineError("the model ended speech before producing any audio")
            wavs = chat._decode_to_wavs(hiddens, True)
        audio = np.clip(np.asarray(wavs[0], dtype=np.float32), -1.0, 1.0)
        return Synthesis(audio=audio, sample_rate=SAMPLE_RATE, steps=steps, spoken_text=text)

    def _refine(self, text: str, seed: int) -> str:
        chat = self._chat
        params = chat.RefineTextParams(manual_seed=seed, show_tqdm=False)
        refined = chat._refine_text([text], chat.device, params)
        ids = [row[row.less(chat.tokenizer.break_0_ids)] for row in refined.ids]
        return chat.tokenizer.decode(ids)[0]

    def warm_up(self, texts=WARMUP_TEXTS, max_steps: int = WARMUP_MAX_STEPS) -> float:
        """Run short texts through the whole pipeline (Numba JIT, allocator, kernels)."""
        started = time.perf_counter()
        for index, text in enumerate(texts):
            try:
                self.synthesize(SynthesisRequest(text=text, seed=index), max_steps=max_steps)
            except NothingToSay:
                pass
        elapsed = time.perf_counter() - started
        log.info("warm-up of %d texts took %.2fs", len(texts), elapsed)
        return elapsed


def _quiet_library_chatter() -> None:
    """transformers warns on every forward pass about ChatTTS's use of ``past_key_values`` and
    draws progress bars while loading; neither tells an operator anything."""
    import warnings

    from transformers.utils import logging as transformers_logging

    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


def _speakable(text: str) -> bool:
    return any(ch.isalnum() for ch in text)
