"""The model facade: loaded once per process, requests batched by one scheduler thread.

ChatTTS's ``Chat.infer`` is not called: it mutates the parameter objects it is given, takes one
speaker and seed per call, splits and re-synthesises text, deletes quiet samples from the output,
and its ``source="local"`` loader runs a downloaded binary. Instead ``loader`` builds ChatTTS's
modules, ``prompts`` builds each prompt as upstream does, a lean int8 decode loop
(``transformer``, ``generation``, ``scheduler``) generates for many requests at once, and
ChatTTS's decoder and vocoder make audio (``decoding``). No HTTP here: the API layer calls
``start`` and reads a ``Run``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from chattts_service.config import Settings
from chattts_service.domain.speech import (
    SAMPLE_RATE,
    EngineError,
    NothingToSay,
    Overloaded,
    Synthesis,
    SynthesisRequest,
    TooManySegments,
)
from chattts_service.domain.voice_store import VoiceStore
from chattts_service.domain.voices import SpeakerSample
from chattts_service.inference.admission import Admission
from chattts_service.inference.fairness import segment_priority
from chattts_service.inference.job import SynthesisJob
from chattts_service.inference.normalising import NormaliserProcess
from chattts_service.inference.policy import BatchingPolicy
from chattts_service.inference.run import Run
from chattts_service.inference.scheduler import QueueFull, Scheduler

if TYPE_CHECKING:  # imported when the model loads (torch), not when the app is built
    from chattts_service.inference.decode_queue import DecodeQueue
    from chattts_service.inference.loader import LoadedModel
    from chattts_service.inference.prompts import Prompts
    from chattts_service.inference.sample_encoder import SampleEncoder

log = logging.getLogger(__name__)

# one segment in both languages: every path (both normalisers, the GPT, decoder and vocoder)
# once, at a fraction of a second; the first real request pays nothing of its own
WARMUP_TEXTS = ("你好，欢迎使用。Hello, welcome.",)
WARMUP_MAX_STEPS = 12


class Engine:
    def __init__(
        self,
        settings: Settings,
        step_observer=None,
        decode_observer=None,
        prefill_observer=None,
        stall_observer=None,
        admitted_observer=None,
        taken_back_observer=None,
    ):
        """``step_observer(rows, seconds)`` is called after every GPT step,
        ``decode_observer(items, seconds)`` after every round of audio decoding,
        ``prefill_observer(positions, seconds)`` after every prompt's prefill (with its first
        token), ``stall_observer(seconds)`` for every gap between two steps of a running batch,
        ``admitted_observer(priority, seconds)`` when a segment gets its first row after
        waiting that long, ``taken_back_observer(priority)`` when a segment of that class takes
        a running one's row."""
        self.settings = settings
        self._decode_observer = decode_observer
        self.decodes: DecodeQueue | None = None  # once loaded
        self.policy = BatchingPolicy.from_settings(settings)
        self.admission = Admission(self.policy)
        self.scheduler = Scheduler(
            self.policy,
            on_step=step_observer,
            on_prefill=prefill_observer,
            on_stall=stall_observer,
            on_admitted=admitted_observer,
            on_taken_back=taken_back_observer,
        )
        self._requests = itertools.count()  # each request's number in the scheduler's shares
        # once loaded: the model and what is built on it
        self.model: LoadedModel | None = None
        self.prompts: Prompts | None = None
        self.voices: VoiceStore | None = None
        self.sample_encoder: SampleEncoder | None = None
        self.sample_rate = SAMPLE_RATE
        self.text_normaliser = NormaliserProcess()  # wetext beside the model, not in its way
        self._normaliser_ready: threading.Thread | None = None

    # -- loading -------------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def _parts(self) -> tuple[LoadedModel, Prompts, SampleEncoder, DecodeQueue, VoiceStore]:
        """What the loaded model brings, or EngineError before it has loaded."""
        model, prompts, encoder = self.model, self.prompts, self.sample_encoder
        decodes, voices = self.decodes, self.voices
        if model is None or prompts is None or encoder is None or decodes is None or voices is None:
            raise EngineError("model is not loaded")
        return model, prompts, encoder, decodes, voices

    def load(self) -> None:
        """Verify (unless disabled) and load the model files; raise ModelFilesError when bad.

        Loading runs on the scheduler's thread, like every later use of the model. The text
        normaliser's grammars load meanwhile on a thread of their own (the load leaves the
        second core idle); ``warm_up`` waits for them."""
        self._normaliser_ready = threading.Thread(
            target=self.text_normaliser.warm_up, name="normaliser-warm-up", daemon=True
        )
        self._normaliser_ready.start()
        self.scheduler.start()
        try:
            self.scheduler.call(self._load_on_model_thread).result()
        except BaseException:
            self.scheduler.stop()
            raise

    def _load_on_model_thread(self) -> None:
        # torch and ChatTTS are imported here, when the model loads, not when the app is built
        from chattts_service.inference.loader import load_model
        from chattts_service.inference.prompts import Prompts
        from chattts_service.inference.sample_encoder import SampleEncoder, decode_prompt

        model = load_model(self.settings)
        self.prompts = Prompts(
            model.chat,
            model.heads,
            model.transformer.max_positions,
            self.settings,
            self.text_normaliser,
        )
        self.voices = VoiceStore(
            self.settings.voices_dir,
            model.chat.speaker.dim,
            self.prompts.speaker_embedding,
            limit=self.settings.max_stored_voices,
            decode_sample=decode_prompt,
        )
        self.sample_encoder = SampleEncoder(model.dvae_file, model.chat.config)
        from chattts_service.inference.decode_queue import DecodeQueue

        self.decodes = DecodeQueue(model.decoder, on_run=self._decode_observer)
        self.scheduler.attach(model.batch, model.kv_positions, self.decodes)
        self.model = model

    @property
    def model_name(self) -> str:
        return self.model.name if self.model is not None else "unloaded"

    @property
    def load_seconds(self) -> float | None:
        return self.model.seconds if self.model is not None else None

    @property
    def kernels(self) -> str:
        return self.model.kernels if self.model is not None else "off"

    @property
    def kernel_instructions(self) -> str:
        return self.model.instructions if self.model is not None else "none"

    @property
    def gpt_linear_kernel(self) -> str:
        return self.model.transformer.linear_kernel if self.model is not None else ""

    @property
    def kernel_tuning(self) -> str:
        """How the int8 product prefetches, and where that choice came from."""
        chosen = self.model.transformer.tuning if self.model is not None else None
        return chosen.describe() if chosen is not None else ""

    @property
    def gpt_linear_bytes(self) -> int:
        return self.model.transformer.linear_bytes if self.model is not None else 0

    @property
    def kv_cache_dtype(self) -> str:
        return self.model.transformer.cache_kind if self.model is not None else ""

    @property
    def context_steps(self) -> int:
        return self.model.decoder.context_steps if self.model is not None else 0

    @property
    def identity(self) -> str:
        """Names everything that shapes the audio besides the request: model and precisions."""
        return (
            f"{self.model_name}/gpt-{self.settings.quantize}"
            f"/decoder-{self.settings.resolved_decoder_dtype}/kernels-{self.kernels}"
            f"/kv-{self.kv_cache_dtype}"
            + ("/long-first" if self.settings.long_text_voice == "first_segment" else "")
        )

    def tune(self, **changes: int) -> dict[str, int]:
        """Change the batching policy on the running engine (see ``BatchingPolicy.tune``);
        it takes effect between two steps."""
        current = self.policy.tune(**changes)
        self.scheduler.policy_changed()
        return current

    # -- requests ------------------------------------------------------------------------------

    def speaker_embedding(self, seed: int):
        return self._parts()[1].speaker_embedding(seed)

    def segments(self, request: SynthesisRequest) -> list[str]:
        """The request's text as the model will read it (see ``Prompts.segments``)."""
        return self._parts()[1].segments(request)

    def encode_sample(self, samples: np.ndarray):
        """A recording (float32 mono, 24 kHz) -> ChatTTS's speaker prompt codes. Runs on the
        calling thread, one recording at a time, beside generation (which it slows, never
        stops); refused like a request when the queue is full or the wait too long."""
        encoder = self._parts()[2]
        self.admission.check(self.scheduler, 1)
        return encoder(samples)

    def sample_prompt(self, codes) -> str:
        """The string a stored voice keeps of a recording's codes (ChatTTS's
        ``Speaker.encode_prompt``)."""
        from chattts_service.inference.sample_encoder import encode_prompt

        return encode_prompt(codes)

    def input_tokens(self, request: SynthesisRequest) -> int:
        """The request's text tokens, as OpenAI's usage counts input (see ``Prompts``)."""
        return self._parts()[1].input_tokens(request)

    def estimated_wait(self, segments: int = 1) -> float | None:
        return self.admission.estimated_wait(self.scheduler, segments)

    def start(
        self,
        request: SynthesisRequest,
        fixed_steps: int | None = None,
        stream: bool = False,
        step_cap: int | None = None,
        priority: str | None = None,
        tenant: str | None = None,
        early: bool = True,
        share: tuple[int, int] | None = None,
    ) -> Run:
        """Queue every segment of a request; they generate together, in one batch when
        there is room. Raises Overloaded when the queue cannot take them all or the estimated
        wait is longer than the policy allows. ``step_cap`` lowers the per-segment step
        cap (degraded mode). A stream sends chunks from its first steps on (unless not ``early``:
        each segment's audio once it is decoded whole). ``priority``
        (``interactive`` or ``bulk``; None: by its shape, see ``fairness.segment_priority``)
        and ``tenant`` (its API key's name, where keys are configured) place its segments in
        the scheduler's shares; ``share`` (a number from ``request_number`` and the index of
        this part's first segment) places them as part of a request started in parts (the
        spans of a script), which takes its turns as one."""
        _, prompts, _, _, voices = self._parts()
        segments, layout = prompts.split(request)
        voice = request.voice if request.voice is not None else voices.from_seed(request.seed)
        speaker = voice.speaker
        number, first = share if share is not None else (self.request_number(), 0)
        # the request's class; a part of a script counts the segments of the parts before it
        klass = segment_priority(priority, stream, first + len(segments))
        if (
            self.settings.long_text_voice == "first_segment"
            and len(segments) > 1
            and voice.sample is None
        ):
            speaker = self._first_segment_sample(
                segments[0], request, voice, fixed_steps, step_cap, (klass, tenant, number)
            )
        jobs = []
        for index, text in enumerate(segments):
            job = self._job(text, request, speaker, fixed_steps, stream, step_cap, early)
            job.placement = (klass, tenant, number, first + index)
            jobs.append(job)
        self.admission.check(self.scheduler, len(jobs))
        run = Run(jobs, self.settings.segment_pause_ms / 1000.0, layout)
        try:
            for job in jobs:
                self.scheduler.submit(job)
        except QueueFull as error:
            run.cancel()
            raise Overloaded(str(error)) from None
        return run

    def admit(self, segments: int) -> None:
        """Raise unless the queue can take ``segments`` more now (``Overloaded``: later it may)
        or ever (``TooManySegments``: more than ``max_queue``). For a script's spans, started
        together; a single text is refused as overloaded (``start``), as it always was."""
        if segments > self.policy.max_queue:
            raise TooManySegments(
                f"it needs {segments} segments at once; the queue holds {self.policy.max_queue} "
                "(CHATTTS_MAX_QUEUE): send it in parts"
            )
        self.admission.check(self.scheduler, segments)

    def request_number(self) -> int:
        """A request's number in the scheduler's shares."""
        return next(self._requests)

    def _job(self, text, request, speaker, fixed_steps, stream, step_cap, early=True):
        """One segment's job, its time fed to the admission's wait estimate."""
        _, prompts, _, decodes, _ = self._parts()
        return SynthesisJob(
            prompts,
            decodes,
            text,
            request,
            speaker,
            fixed_steps,
            stream,
            step_cap,
            on_finished=self.admission.job_finished,
            lookahead=self.settings.stream_lookahead,
            early=early,
        )

    def _first_segment_sample(
        self, text, request, voice, fixed_steps, step_cap, placement
    ) -> SpeakerSample:
        """Upstream's long text (``Chat.infer(split_text=True)``): the first segment alone in
        the voice, its audio encoded as a recording (``sample_audio_speaker``), and that with
        the first segment's words as the sample every segment is then spoken from, the
        embedding kept as well. Waits for that segment here, on the caller's thread."""
        reference = self._job(text, request, voice.embedding, fixed_steps, False, step_cap)
        klass, tenant, number = placement
        reference.placement = (klass, tenant, number, 0)
        self.admission.check(self.scheduler, 1)
        run = Run([reference], 0.0)
        try:
            self.scheduler.submit(reference)
        except QueueFull as error:
            raise Overloaded(str(error)) from None
        first = run.result(self.settings.request_timeout_s)
        codes = self._parts()[2](first.audio)
        return SpeakerSample(codes, first.spoken_text, embedding=voice.embedding)

    def submit(self, request: SynthesisRequest, fixed_steps: int | None = None) -> Future:
        """Queue a one-segment request; the future gives its Synthesis."""
        run = self.start(request, fixed_steps)
        if len(run.jobs) != 1:
            run.cancel()
            raise EngineError("submit takes one segment; use start() for long text")
        return run.jobs[0].future

    def synthesize(
        self,
        request: SynthesisRequest,
        fixed_steps: int | None = None,
        timeout: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Synthesis:
        """Generate and wait. After ``timeout`` seconds, or as soon as ``should_stop()`` says so
        (checked every quarter second), the request is dropped from the batch and this raises
        DeadlineExceeded or Cancelled: nobody is left to take the audio."""
        return self.start(request, fixed_steps).result(timeout, should_stop)

    def decode(self, hiddens, decoder_dtype: str | None = None) -> np.ndarray:
        """GPT hidden states [steps, hidden] -> waveform (see ``decoding.AudioDecoder``)."""
        return self._parts()[0].decoder(hiddens, decoder_dtype)

    def warm_up(self, texts=WARMUP_TEXTS, max_steps: int = WARMUP_MAX_STEPS) -> float:
        """Run short texts through the whole pipeline (normalisers, allocator, kernels)."""
        started = time.perf_counter()
        if self._normaliser_ready is not None:
            self._normaliser_ready.join()
        else:
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
        self.scheduler.stop()
        self.text_normaliser.close()
