"""The model: loaded once per process, requests batched by one scheduler thread, no HTTP here.

ChatTTS's ``Chat.infer`` is not called: it mutates the parameter objects it is given, takes one
speaker and seed per call, splits and re-synthesises text, deletes quiet samples from the output,
and its ``source="local"`` loader runs a downloaded binary. The engine loads ChatTTS's modules
itself (``_load_modules``) and drives them: ChatTTS's normaliser, tokenizer, embeddings and
speaker code build the prompt; a lean int8 decode loop (``transformer``, ``generation``,
``scheduler``) generates for many requests at once; ChatTTS's decoder and vocoder make audio.
"""

from __future__ import annotations

import gc
import logging
import queue
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from . import heap, model_files
from .architecture import config_from_architecture, read_architecture
from .audio import silence
from .config import Settings
from .text import Normaliser, pack, split_sentences
from .voices import Voice, VoiceStore

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
SAMPLES_PER_STEP = 512                # 2 mel frames of hop 256 per GPT step
DEFAULT_SPEED = 5                     # ChatTTS's default speech prompt is [speed_5]
FIRST_CHUNK_STEPS = 8                 # streamed audio: first chunk (170 ms), then doubling
MAX_CHUNK_STEPS = 96
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
    """No room: the queue is full, or the estimated wait is longer than allowed."""

    def __init__(self, message: str, reason: str = "queue_full", retry_after: float = 5.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class Cancelled(EngineError):
    """The caller went away before the audio was ready; its work was dropped."""


class DeadlineExceeded(Cancelled):
    """The request did not finish within its time limit; its work was dropped."""


@dataclass(frozen=True)
class SynthesisRequest:
    """Everything that changes the audio. The cache key is built from these fields."""

    text: str
    seed: int                     # sampling seed; also the voice when ``voice`` is None
    refine_text: bool = False
    voice: Voice | None = None
    speed: int = DEFAULT_SPEED    # ChatTTS's [speed_N] level, 0-9
    temperature: float = 0.3      # ChatTTS's defaults for speech codes
    top_p: float = 0.7
    top_k: int = 20
    normalize: bool = True        # numbers, dates, money... written out in words first
    refine_prompt: str = ""       # [oral_N][laugh_N][break_N] for the refinement pass


@dataclass(frozen=True)
class Synthesis:
    audio: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int
    steps: int
    spoken_text: str
    segments: int = 1
    truncated: int = 0  # segments stopped by the step cap instead of ending their speech

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sample_rate


class _SynthesisJob:
    """One segment inside the scheduler: optional text refinement, speech codes, then audio.

    Every method runs on the scheduler's thread, which owns all heavy torch work. A streaming
    job decodes its audio in chunks while it generates (``progress``); each chunk is decoded
    with enough context on both sides (the decoders' receptive field) to be identical to the
    same stretch of a decode of the whole, so streamed and non-streamed audio match."""

    def __init__(self, engine: "Engine", text: str, request: SynthesisRequest, voice,
                 fixed_steps: int | None, stream: bool, step_cap: int | None = None):
        self.engine, self.text, self.request, self.voice = engine, text, request, voice
        self.fixed_steps, self.step_cap = fixed_steps, step_cap
        self.started: float | None = None
        from .scheduler import JobFuture  # the scheduler imports torch; keep import time light

        self.future = JobFuture()
        self.chunks: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        self._parts: list[np.ndarray] = []
        self._emitted = 0  # steps whose audio has been sent
        self._next_chunk = FIRST_CHUNK_STEPS

    def start(self):
        self.started = time.monotonic()
        if self.request.refine_text:
            return self.engine._text_sequence(self.text, self.request)
        return self.engine._code_sequence(self.text, self.request, self.voice, self.fixed_steps,
                                          self.step_cap)

    def progress(self, sequence) -> None:
        if self.chunks is None or sequence.kind != "code":
            return
        ready = sequence.steps - self.engine.context_steps
        if ready - self._emitted >= self._next_chunk:
            self._emit(sequence, ready, final=False)
            self._next_chunk = min(2 * self._next_chunk, MAX_CHUNK_STEPS)

    def _emit(self, sequence, until: int, final: bool) -> None:
        start = max(0, self._emitted - self.engine.context_steps)
        audio = self.engine.decode(sequence.hiddens[start:sequence.steps])
        first = (self._emitted - start) * SAMPLES_PER_STEP
        last = len(audio) if final else (until - start) * SAMPLES_PER_STEP
        chunk = audio[first:last]
        self._parts.append(chunk)
        self.chunks.put(chunk)
        self._emitted = until

    def advance(self, finished):
        if finished.kind == "text":
            self.text = self.engine._refined_text(finished)
            if not _speakable(self.text):
                raise NothingToSay("text has nothing speakable after refinement")
            return self.engine._code_sequence(self.text, self.request, self.voice,
                                              self.fixed_steps, self.step_cap)
        if finished.steps == 0:
            raise EngineError("the model ended speech before producing any audio")
        if self.chunks is not None:
            self._emit(finished, finished.steps, final=True)
            self.chunks.put(None)
            audio = np.concatenate(self._parts)
        else:
            audio = self.engine.decode(finished.result_hiddens())
        truncated = self.fixed_steps is None and finished.steps >= finished.max_steps
        if truncated:
            log.warning("a segment reached its step cap (%d steps) before ending its speech",
                        finished.max_steps)
        self.engine._job_finished(time.monotonic() - self.started)
        self.future.set_result(Synthesis(audio=audio, sample_rate=SAMPLE_RATE,
                                         steps=finished.steps, spoken_text=self.text,
                                         truncated=int(truncated)))
        return None


class Run:
    """The segments of one request, generating in the scheduler; waited on or streamed."""

    def __init__(self, jobs: list[_SynthesisJob], pause_seconds: float):
        self.jobs = jobs
        self.pause = silence(pause_seconds, SAMPLE_RATE)

    def cancel(self) -> None:
        for job in self.jobs:
            job.future.cancel()

    def result(self, timeout: float | None = None,
               should_stop: Callable[[], bool] | None = None) -> Synthesis:
        """Wait for every segment and join them with a short pause."""
        deadline = _deadline(timeout)
        try:
            parts = [self._wait(job, deadline, timeout, should_stop) for job in self.jobs]
        except BaseException:
            self.cancel()
            raise
        pieces = []
        for index, part in enumerate(parts):
            if index:
                pieces.append(self.pause)
            pieces.append(part.audio)
        return Synthesis(audio=np.concatenate(pieces), sample_rate=SAMPLE_RATE,
                         steps=sum(part.steps for part in parts),
                         spoken_text=" ".join(part.spoken_text for part in parts),
                         segments=len(parts), truncated=self.truncated)

    @property
    def truncated(self) -> int:
        """Segments stopped by their step cap; read once every segment has finished."""
        return sum(job.future.result().truncated for job in self.jobs)

    def chunks(self, timeout: float | None = None,
               should_stop: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """Audio as it is decoded, segment after segment (the same samples ``result`` joins).
        Closing the iterator early cancels what is still generating."""
        deadline = _deadline(timeout)
        try:
            for index, job in enumerate(self.jobs):
                if index:
                    yield self.pause
                while True:
                    try:
                        chunk = job.chunks.get(timeout=_poll(deadline))
                    except queue.Empty:
                        # a finished job's chunks, end marker included, are already queued
                        self._check(job, deadline, timeout, should_stop)
                        continue
                    if chunk is None:
                        break
                    yield chunk
        finally:
            if not all(job.future.done() for job in self.jobs):
                self.cancel()

    def _wait(self, job, deadline, timeout, should_stop) -> Synthesis:
        while True:
            try:
                return _future_result(job.future, _poll(deadline))
            except FutureTimeout:
                self._check(job, deadline, timeout, should_stop)

    @staticmethod
    def _check(job, deadline, timeout, should_stop) -> None:
        """Raise if the job failed, its deadline passed or its client left."""
        if job.future.done():
            _future_result(job.future, 0)  # raises its failure
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded(f"not finished within {timeout:g} s")
        if should_stop is not None and should_stop():
            raise Cancelled("the client went away")


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _poll(deadline: float | None) -> float:
    if deadline is None:
        return STOP_POLL_SECONDS
    return min(STOP_POLL_SECONDS, max(0.0, deadline - time.monotonic()))


def _future_result(future, wait):
    from .scheduler import JobCancelled

    try:
        return future.result(wait)
    except FutureTimeout:
        raise
    except (JobCancelled, CancelledError) as error:
        raise Cancelled(str(error) or "cancelled") from None
    except EngineError:
        raise
    except Exception as error:  # a failure inside the model thread, logged there
        raise EngineError(f"{error.__class__.__name__}: {error}") from error


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
        self.gpt_linear_kernel = ""
        self.kv_cache_dtype = ""
        self.kernels = "off"  # until load() builds the transformer
        self.sample_rate = SAMPLE_RATE
        self.context_steps = 0  # decoder + vocoder receptive field, in GPT steps per side
        self.voices: VoiceStore | None = None
        self._job_seconds: float | None = None  # recent average time of one job
        self.max_wait_s = settings.max_wait_s  # tunable at run time (routes/admin.py)
        self.text_normaliser = Normaliser()

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
        self.context_steps = decoder_context_steps(self._chat.decoder, self._chat.vocos)
        self.voices = VoiceStore(self.settings.voices_dir, self._chat.speaker.dim,
                                 self.speaker_embedding)
        self.model_name = (architecture or {}).get("name", "chattts")
        self.load_seconds = time.perf_counter() - started
        log.info("model %s loaded from %s in %.2fs (%s GPT linears on %s, %.0f MB; "
                 "C++ kernels %s; %s KV cache; %s decoder; %d torch threads)", self.model_name,
                 model_dir, self.load_seconds, self.settings.quantize, self.gpt_linear_kernel,
                 self.gpt_linear_bytes / 1e6, self.kernels, self.kv_cache_dtype,
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
        transformer = Transformer(llama, settings.quantize, settings.kernels,
                                  settings.int8_product, settings.kv_cache_dtype)
        self.gpt_linear_bytes = transformer.linear_bytes
        self.gpt_linear_kernel = transformer.linear_kernel
        self.kv_cache_dtype = transformer.cache_kind
        self.kernels = "on" if transformer.kernels is not None else "off"
        del llama
        gc.collect()

        embed = Embed(config.embed.hidden_size, config.embed.num_audio_tokens,
                      config.embed.num_text_tokens, config.embed.num_vq)
        embed.load_state_dict(load_safetensors(str(paths.embed)), assign=True)
        self._heads = Heads(embed.eval().requires_grad_(False), rows=settings.max_batch,
                            quantization=settings.quantize, kernels=transformer.kernels)
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
        heap.release()
        kv_positions = settings.kv_cache_mb * 2**20 // transformer.bytes_per_position()
        batch = Batch(transformer, self._heads, settings.max_batch, on_empty=heap.release)
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

    def _code_sequence(self, text: str, request: SynthesisRequest, voice,
                       fixed_steps: int | None = None, step_cap: int | None = None):
        import torch

        from .generation import CODE_SAMPLING, Sampling, Sequence

        chat = self._chat
        seed = request.seed
        sampling = Sampling(request.temperature, request.top_p, request.top_k,
                            CODE_SAMPLING.repetition_penalty)
        decorated = chat.speaker.decorate_code_prompts([text], f"[speed_{request.speed}]", None,
                                                       voice)[0]
        input_ids, embeddings = self._prompt(decorated)
        with torch.inference_mode():
            chat.speaker.apply(embeddings, voice, input_ids, chat.tokenizer.spk_emb_ids,
                               torch.device("cpu"))
        # the GPT's position table bounds prompt + speech
        room = self.scheduler.batch.transformer.max_positions - embeddings.shape[1]
        if room < 1:
            raise EngineError(f"text is too long for the model ({embeddings.shape[1]} tokens)")
        max_steps = min(fixed_steps or self.max_steps_for(text), room, step_cap or room)
        # at least one step: a generation that ends at once would be an empty answer
        min_steps = min(fixed_steps or 1, max_steps)
        return Sequence(embeddings[0].clone(), self._heads, sampling, seed, max_steps,
                        min_steps, eos_token=self._heads.num_audio_tokens - 1)

    def _text_sequence(self, text: str, request: SynthesisRequest):
        from .generation import TEXT_SAMPLING, TextSequence

        chat = self._chat
        decorated = chat.speaker.decorate_text_prompts([text], request.refine_prompt)[0]
        _, embeddings = self._prompt(decorated)
        return TextSequence(embeddings[0].clone(), self._heads, TEXT_SAMPLING, request.seed,
                            REFINE_MAX_STEPS, 0, eos_token=chat.tokenizer.eos_token)

    def _refined_text(self, finished) -> str:
        chat = self._chat
        ids = finished.result_tokens()[:, 0]
        ids = ids[ids < chat.tokenizer.break_0_ids]
        return chat.tokenizer.decode([ids])[0]

    # -- inference -----------------------------------------------------------------------------

    def normalise(self, text: str, normalize: bool = True) -> str:
        """Numbers and symbols written out (``wetext``, when ``normalize``), then ChatTTS's own
        normaliser; raises NothingToSay when nothing speakable is left."""
        if normalize:
            text = self.text_normaliser(text)
        normalised = self._chat.normalizer(text, do_text_normalization=True,
                                           do_homophone_replacement=True)
        if not _speakable(normalised):
            raise NothingToSay("text has nothing speakable after normalisation")
        return normalised

    def segments(self, request: SynthesisRequest) -> list[str]:
        """The request's text as the model will read it: sentences normalised one by one (so
        each gets its own language), packed into segments of at most the configured length."""
        sentences = []
        for sentence in split_sentences(request.text):
            try:
                sentences.append(self.normalise(sentence, request.normalize))
            except NothingToSay:
                continue  # punctuation or symbols alone: nothing to say, nothing lost
        if not sentences:
            raise NothingToSay("text has nothing speakable after normalisation")
        return pack(sentences, self.settings.max_segment_chars)

    def _job_finished(self, seconds: float) -> None:
        """Scheduler thread: a job's time from start to audio, for the wait estimate."""
        previous = self._job_seconds
        self._job_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def estimated_wait(self, segments: int = 1) -> float | None:
        """Seconds until ``segments`` new jobs would be done: the jobs ahead and these, run
        ``max_batch`` at a time, each taking the recent average. None before any job ran."""
        if self._job_seconds is None or self.scheduler is None:
            return None
        ahead = self.scheduler.depth + segments
        return -(-ahead // self.scheduler.max_batch) * self._job_seconds

    def start(self, request: SynthesisRequest, fixed_steps: int | None = None,
              stream: bool = False, step_cap: int | None = None) -> Run:
        """Queue every segment of a request; they generate together, in one batch when
        there is room. Raises Overloaded when the queue cannot take them all or the estimated
        wait is longer than ``CHATTTS_MAX_WAIT_S``. ``step_cap`` lowers the per-segment step
        cap (degraded mode)."""
        from .scheduler import QueueFull

        if self._chat is None:
            raise EngineError("model is not loaded")
        segments = self.segments(request)
        voice = request.voice if request.voice is not None \
            else self.voices.from_seed(request.seed)
        jobs = [_SynthesisJob(self, text, request, voice.embedding, fixed_steps, stream, step_cap)
                for text in segments]
        wait = self.estimated_wait(len(jobs))
        if self.scheduler.free_queue_slots() < len(jobs):
            raise Overloaded(f"the queue has no room for {len(jobs)} segment(s)",
                             retry_after=wait or 5.0)
        if self.max_wait_s and wait is not None and wait > self.max_wait_s:
            raise Overloaded(f"the estimated wait ({wait:.0f} s) is longer than "
                             f"{self.max_wait_s} s", reason="wait", retry_after=wait)
        run = Run(jobs, self.settings.segment_pause_ms / 1000.0)
        try:
            for job in jobs:
                self.scheduler.submit(job)
        except QueueFull as error:
            run.cancel()
            raise Overloaded(str(error)) from None
        return run

    def submit(self, request: SynthesisRequest, fixed_steps: int | None = None) -> Future:
        """Queue a one-segment request; the future gives its Synthesis."""
        run = self.start(request, fixed_steps)
        if len(run.jobs) != 1:
            run.cancel()
            raise EngineError("submit takes one segment; use start() for long text")
        return run.jobs[0].future

    def synthesize(self, request: SynthesisRequest, fixed_steps: int | None = None,
                   timeout: float | None = None,
                   should_stop: Callable[[], bool] | None = None) -> Synthesis:
        """Generate and wait. After ``timeout`` seconds, or as soon as ``should_stop()`` says so
        (checked every quarter second), the request is dropped from the batch and this raises
        DeadlineExceeded or Cancelled: nobody is left to take the audio."""
        return self.start(request, fixed_steps).result(timeout, should_stop)

    @property
    def identity(self) -> str:
        """Names everything that shapes the audio besides the request: model and precisions."""
        return (f"{self.model_name}/gpt-{self.settings.quantize}"
                f"/decoder-{self.settings.resolved_decoder_dtype}/kernels-{self.kernels}"
                f"/kv-{self.kv_cache_dtype}")

    def decode(self, hiddens, decoder_dtype: str | None = None) -> np.ndarray:
        """GPT hidden states [steps, hidden] -> waveform, via ChatTTS's decoder and vocoder.

        The decoder and the vocoder's ConvNeXt backbone may run in bf16 (on CPUs with native
        bf16: 85 -> 55 ms for 150 steps, measured waveform difference ~1%); the vocoder's
        head (its complex inverse STFT) stays in fp32."""
        import torch

        chat = self._chat
        bf16 = (decoder_dtype or self.settings.resolved_decoder_dtype) == "bf16"
        with torch.inference_mode():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                mel = chat.decoder(hiddens.T[None].contiguous())
                features = chat.vocos.backbone(mel.float())
            audio = chat.vocos.head(features.float())[0]
        return np.clip(audio.numpy().astype(np.float32, copy=False), -1.0, 1.0)

    def warm_up(self, texts=WARMUP_TEXTS, max_steps: int = WARMUP_MAX_STEPS) -> float:
        """Run short texts through the whole pipeline (Numba JIT, allocator, kernels)."""
        started = time.perf_counter()
        self.text_normaliser.warm_up()
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


def decoder_context_steps(decoder, vocos) -> int:
    """How many GPT steps on each side of an audio sample can change it: the receptive field of
    the decoder's and the vocoder's convolutions plus the inverse STFT's window, in mel frames
    (two per step). A chunk decoded with this much context on both sides is the same as that
    stretch of a decode of the whole."""
    import torch

    frames = 0
    for module in (decoder, vocos.backbone):
        for conv in module.modules():
            if isinstance(conv, torch.nn.Conv1d):
                frames += conv.dilation[0] * (conv.kernel_size[0] - 1) // 2
    head = vocos.head
    frames += head.istft.win_length // head.istft.hop_length // 2
    return -(-frames // 2)


def voice_for_seed(speaker, seed: int):
    """A reproducible voice from ChatTTS's ``Speaker`` statistics, drawn without touching the
    global RNG (upstream's ``sample_random_speaker`` does)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(speaker.dim, generator=generator, dtype=torch.float32)
    return noise * speaker.std.float() + speaker.mean.float()


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


def compile_normaliser_jit() -> float:
    """Compile ChatTTS's Numba functions into ``NUMBA_CACHE_DIR`` (which must be set) by running
    its normaliser over the warm-up texts and a tagged one; returns the seconds it took. The
    image does this at build time and its entrypoint copies the result into the cache tmpfs, so
    that a container's first start finds them compiled too."""
    import os

    if not os.environ.get("NUMBA_CACHE_DIR"):
        raise RuntimeError("NUMBA_CACHE_DIR must name the directory to compile into")
    started = time.perf_counter()
    _cache_normaliser_jit()
    from ChatTTS import Chat

    normalizer = Chat(logging.getLogger("ChatTTS")).normalizer
    # a tag beside a character ChatTTS rejects ("-") takes it through all four functions
    for text in (*WARMUP_TEXTS, "你好 [uv_break] hello-world [laugh]"):
        normalizer(text, do_text_normalization=True, do_homophone_replacement=True)
    return time.perf_counter() - started


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
