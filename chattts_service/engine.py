"""The model: loaded once per process, requests batched by one scheduler thread, no HTTP here.

ChatTTS's ``Chat.infer`` is not called: it mutates the parameter objects it is given, takes one
speaker and seed per call, splits and re-synthesises text, deletes quiet samples from the output,
and its ``source="local"`` loader runs a downloaded binary. The engine loads ChatTTS's modules
itself (``_load_modules``) and drives them: ChatTTS's normaliser, tokenizer, embeddings and
speaker code build the prompt; a lean int8 decode loop (``transformer``, ``generation``,
``scheduler``) generates for many requests at once; ChatTTS's decoder and vocoder make audio.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from . import model_files
from .architecture import config_from_architecture, read_architecture
from .config import Settings

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
CODE_PROMPT = "[speed_5]"             # ChatTTS's default speech prompt
BASE_STEPS = 150                      # headroom of the per-request step cap
REFINE_MAX_STEPS = 384                # ChatTTS's default for text refinement

STOP_POLL_SECONDS = 0.25               # how often a waiting request checks its client

WARMUP_TEXTS = ("你好，欢迎使用语音合成服务。", "Hello, this is a warm-up sentence.")
WARMUP_MAX_STEPS = 24


class EngineError(Exception):
    """Inference could not produce audio for a request."""


class NothingToSay(EngineError):
    """After text normalisation nothing speakable is left."""


class Overloaded(EngineError):
    """The request queue is full."""


class Cancelled(EngineError):
    """The caller went away before the audio was ready; its work was dropped."""


class DeadlineExceeded(Cancelled):
    """The request did not finish within its time limit; its work was dropped."""


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


class _SynthesisJob:
    """One request inside the scheduler: optional text refinement, speech codes, then audio.

    Every method runs on the scheduler's thread, which owns all heavy torch work."""

    def __init__(self, engine: "Engine", text: str, seed: int, refine: bool,
                 fixed_steps: int | None):
        self.engine, self.text, self.seed = engine, text, seed
        self.refine, self.fixed_steps = refine, fixed_steps
        from .scheduler import JobFuture  # the scheduler imports torch; keep import time light

        self.future = JobFuture()

    def start(self):
        if self.refine:
            return self.engine._text_sequence(self.text, self.seed)
        return self.engine._code_sequence(self.text, self.seed, self.fixed_steps)

    def advance(self, finished):
        if finished.kind == "text":
            self.text = self.engine._refined_text(finished)
            if not _speakable(self.text):
                raise NothingToSay("text has nothing speakable after refinement")
            return self.engine._code_sequence(self.text, self.seed, self.fixed_steps)
        if finished.steps == 0:
            raise EngineError("the model ended speech before producing any audio")
        audio = self.engine.decode(finished.result_hiddens())
        self.future.set_result(Synthesis(audio=audio, sample_rate=SAMPLE_RATE,
                                         steps=finished.steps, spoken_text=self.text))
        return None


class Engine:
    def __init__(self, settings: Settings, step_observer=None):
        """``step_observer(rows, seconds)`` is called after every decode step."""
        self.settings = settings
        self.step_observer = step_observer
        self._chat = None
        self._heads = None
        self.scheduler = None
        self.model_name = "unloaded"
        self.load_seconds: float | None = None
        self.gpt_linear_bytes = 0

    # -- loading -------------------------------------------------------------------------------

    def load(self) -> None:
        """Verify (unless disabled) and load the model files; raise ModelFilesError when bad.

        Loading runs on the scheduler's thread, like every later use of the model."""
        from .scheduler import Scheduler

        settings = self.settings
        self.scheduler = Scheduler(settings.max_batch, settings.batch_wait_ms / 1000.0,
                                   settings.max_queue, on_step=self.step_observer)
        self.scheduler.start()
        try:
            self.scheduler.call(self._load_on_model_thread).result()
        except BaseException:
            self.scheduler.stop()
            raise

    def _load_on_model_thread(self) -> None:
        import torch

        _quiet_library_chatter()
        _cache_normaliser_jit()
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

        self._chat = self._load_modules(paths, architecture)
        self.model_name = (architecture or {}).get("name", "chattts")
        self.load_seconds = time.perf_counter() - started
        log.info("model %s loaded from %s in %.2fs (%s GPT linears, %.0f MB; %s decoder; "
                 "%d torch threads)", self.model_name, model_dir, self.load_seconds,
                 self.settings.quantize, self.gpt_linear_bytes / 1e6,
                 self.settings.resolved_decoder_dtype, self.settings.torch_threads)

    def _load_modules(self, paths: model_files.ModelPaths, architecture):
        """Load ChatTTS's modules in the order that keeps peak memory lowest.

        The same steps as ``Chat._load`` minus what the service never uses (the DVAE encoder,
        the weight-normalised heads, the transformers GPT once quantised), and the GPT first:
        its fp32 weights are memory-mapped, read once into the lean int8 transformer and
        unmapped before anything else is loaded. Loaded state dicts are assigned, not copied.
        """
        from ChatTTS import Chat
        from ChatTTS.model import DVAE, Embed, Speaker, Tokenizer
        from safetensors.torch import load_file as load_safetensors
        from transformers import LlamaModel
        from vocos import Vocos
        from vocos.pretrained import instantiate_class

        from .generation import Batch, Heads
        from .transformer import Transformer

        settings = self.settings
        chat = Chat(logging.getLogger("ChatTTS"))
        config = chat.config = config_from_architecture(architecture)

        llama = LlamaModel.from_pretrained(str(paths.gpt))
        transformer = Transformer(llama, settings.quantize)
        self.gpt_linear_bytes = transformer.linear_bytes
        del llama
        gc.collect()

        embed = Embed(config.embed.hidden_size, config.embed.num_audio_tokens,
                      config.embed.num_text_tokens, config.embed.num_vq)
        embed.load_state_dict(load_safetensors(str(paths.embed)), assign=True)
        self._heads = Heads(embed.eval().requires_grad_(False), rows=settings.max_batch)
        del embed.head_text, embed.head_code  # folded into Heads
        chat.embed = embed

        decoder = DVAE(decoder_config=asdict(config.decoder), dim=config.decoder.idim)
        decoder.load_state_dict(load_safetensors(str(paths.decoder)), assign=True)
        chat.decoder = decoder.eval().requires_grad_(False)

        vocos = Vocos(
            feature_extractor=instantiate_class(args=(), init=asdict(config.vocos.feature_extractor)),
            backbone=instantiate_class(args=(), init=asdict(config.vocos.backbone)),
            head=instantiate_class(args=(), init=asdict(config.vocos.head)),
        )
        vocos.load_state_dict(load_safetensors(str(paths.vocos)), assign=True)
        chat.vocos = vocos.eval().requires_grad_(False)

        chat.speaker = Speaker(config.gpt.hidden_size, config.spk_stat)
        chat.tokenizer = Tokenizer(str(paths.tokenizer))
        if chat.tokenizer.len != config.gpt.num_text_tokens:
            raise model_files.ModelFilesError(
                f"tokenizer in {paths.tokenizer} has {chat.tokenizer.len} tokens, "
                f"the model expects {config.gpt.num_text_tokens}")

        gc.collect()
        release_free_memory()
        kv_positions = settings.kv_cache_mb * 2**20 // transformer.bytes_per_position()
        batch = Batch(transformer, self._heads, settings.max_batch, on_empty=release_free_memory)
        self.scheduler.attach(batch, kv_positions)
        return chat

    # -- prompts and sequences (run on the scheduler's thread) --------------------------------

    def speaker_embedding(self, seed: int):
        return voice_for_seed(self._chat.speaker, seed)

    def max_steps_for(self, text: str) -> int:
        """Step cap for a text: speech far longer than its text is a runaway generation."""
        by_length = BASE_STEPS + self.settings.max_steps_per_char * len(text)
        return min(self.settings.max_new_tokens, by_length)

    def _prompt(self, decorated: str):
        import torch

        chat = self._chat
        with torch.inference_mode():
            input_ids, _, text_mask = chat.tokenizer.encode([decorated], chat.config.gpt.num_vq)
            embeddings = chat.embed(input_ids, text_mask)
        return input_ids, embeddings

    def _code_sequence(self, text: str, seed: int, fixed_steps: int | None = None):
        import torch

        from .generation import CODE_SAMPLING, Sequence

        chat = self._chat
        voice = self.speaker_embedding(seed)
        decorated = chat.speaker.decorate_code_prompts([text], CODE_PROMPT, None, voice)[0]
        input_ids, embeddings = self._prompt(decorated)
        with torch.inference_mode():
            chat.speaker.apply(embeddings, voice, input_ids, chat.tokenizer.spk_emb_ids,
                               torch.device("cpu"))
        # the GPT's position table bounds prompt + speech
        room = self.scheduler.batch.transformer.max_positions - embeddings.shape[1]
        if room < 1:
            raise EngineError(f"text is too long for the model ({embeddings.shape[1]} tokens)")
        max_steps = min(fixed_steps or self.max_steps_for(text), room)
        # at least one step: a generation that ends at once would be an empty answer
        min_steps = min(fixed_steps or 1, max_steps)
        return Sequence(embeddings[0].clone(), self._heads, CODE_SAMPLING, seed, max_steps,
                        min_steps, eos_token=self._heads.num_audio_tokens - 1)

    def _text_sequence(self, text: str, seed: int):
        from .generation import TEXT_SAMPLING, TextSequence

        chat = self._chat
        decorated = chat.speaker.decorate_text_prompts([text], "")[0]
        _, embeddings = self._prompt(decorated)
        return TextSequence(embeddings[0].clone(), self._heads, TEXT_SAMPLING, seed,
                            REFINE_MAX_STEPS, 0, eos_token=chat.tokenizer.eos_token)

    def _refined_text(self, finished) -> str:
        chat = self._chat
        ids = finished.result_tokens()[:, 0]
        ids = ids[ids < chat.tokenizer.break_0_ids]
        return chat.tokenizer.decode([ids])[0]

    # -- inference -----------------------------------------------------------------------------

    def normalise(self, text: str) -> str:
        """ChatTTS's own normaliser; raises NothingToSay when nothing speakable is left."""
        normalised = self._chat.normalizer(text, do_text_normalization=True,
                                           do_homophone_replacement=True)
        if not _speakable(normalised):
            raise NothingToSay("text has nothing speakable after normalisation")
        return normalised

    def submit(self, request: SynthesisRequest, fixed_steps: int | None = None) -> Future:
        """Queue a request; the future gives its Synthesis."""
        from .scheduler import QueueFull

        if self._chat is None:
            raise EngineError("model is not loaded")
        text = self.normalise(request.text)
        job = _SynthesisJob(self, text, request.seed, request.refine_text, fixed_steps)
        try:
            return self.scheduler.submit(job)
        except QueueFull as error:
            raise Overloaded(str(error)) from None

    def synthesize(self, request: SynthesisRequest, fixed_steps: int | None = None,
                   timeout: float | None = None,
                   should_stop: Callable[[], bool] | None = None) -> Synthesis:
        """Generate and wait. After ``timeout`` seconds, or as soon as ``should_stop()`` says so
        (checked every quarter second), the request is dropped from the batch and this raises
        DeadlineExceeded or Cancelled: nobody is left to take the audio."""
        from .scheduler import JobCancelled

        future = self.submit(request, fixed_steps)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if should_stop is None else STOP_POLL_SECONDS
            if deadline is not None:
                remaining = max(0.0, deadline - time.monotonic())
                wait = remaining if wait is None else min(wait, remaining)
            try:
                return future.result(wait)
            except FutureTimeout:
                if deadline is not None and time.monotonic() >= deadline:
                    future.cancel()
                    raise DeadlineExceeded(f"not finished within {timeout:g} s") from None
                if should_stop is not None and should_stop():
                    future.cancel()
                    raise Cancelled("the client went away") from None
            except (JobCancelled, CancelledError) as error:
                raise Cancelled(str(error) or "cancelled") from None
            except EngineError:
                raise
            except Exception as error:  # a failure inside the model thread, logged there
                raise EngineError(f"{error.__class__.__name__}: {error}") from error

    @property
    def identity(self) -> str:
        """Names everything that shapes the audio besides the request: model and precisions."""
        return (f"{self.model_name}/gpt-{self.settings.quantize}"
                f"/decoder-{self.settings.resolved_decoder_dtype}")

    def decode(self, hiddens, decoder_dtype: str | None = None) -> np.ndarray:
        """GPT hidden states [steps, hidden] -> waveform, via ChatTTS's decoder and vocoder.

        The decoder may run in bf16 (about 1.7x faster on CPUs with native bf16, measured
        waveform error ~0.6%); the vocoder's complex inverse STFT stays in fp32."""
        import torch

        chat = self._chat
        bf16 = (decoder_dtype or self.settings.resolved_decoder_dtype) == "bf16"
        with torch.inference_mode():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                mel = chat.decoder(hiddens.T[None].contiguous())
            audio = chat.vocos.decode(mel.float())[0]
        return np.clip(audio.numpy().astype(np.float32, copy=False), -1.0, 1.0)

    def warm_up(self, texts=WARMUP_TEXTS, max_steps: int = WARMUP_MAX_STEPS) -> float:
        """Run short texts through the whole pipeline (Numba JIT, allocator, kernels)."""
        started = time.perf_counter()
        for index, text in enumerate(texts):
            try:
                self.synthesize(SynthesisRequest(text=text, seed=index), fixed_steps=max_steps)
            except NothingToSay:
                pass
        elapsed = time.perf_counter() - started
        log.info("warm-up of %d texts took %.2fs", len(texts), elapsed)
        return elapsed

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()


def voice_for_seed(speaker, seed: int):
    """A reproducible voice from ChatTTS's ``Speaker`` statistics, drawn without touching the
    global RNG (upstream's ``sample_random_speaker`` does)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(speaker.dim, generator=generator, dtype=torch.float32)
    return noise * speaker.std.float() + speaker.mean.float()


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS. glibc keeps large freed blocks in its arenas, so
    without this a burst of long requests leaves RSS high long after their caches are gone
    (measured: 520 MB kept after loading the full model)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _cache_normaliser_jit() -> None:
    """Let ChatTTS's Numba functions use NUMBA_CACHE_DIR.

    They are declared without ``cache=True``, so every process compiles them again on first use
    (~3 s of the time to ready). Re-declared with caching, a restarted worker finds them
    compiled in the cache directory (a tmpfs in the container)."""
    import os

    if not os.environ.get("NUMBA_CACHE_DIR"):
        return
    import numba
    from ChatTTS import norm

    for name in ("_find_index", "_fast_replace", "_split_tags", "_combine_tags"):
        function = getattr(norm, name)
        if getattr(function, "_chattts_service_cached", False):
            continue
        cached = numba.jit(nopython=True, cache=True)(function.py_func)
        cached._chattts_service_cached = True
        setattr(norm, name, cached)


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
