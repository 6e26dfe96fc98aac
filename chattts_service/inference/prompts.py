"""From text to the sequences the scheduler generates, with ChatTTS's own pieces.

ChatTTS's normaliser, tokenizer, embeddings and speaker code build each prompt exactly as
``Chat.infer`` would; wetext writes numbers and symbols out first. Runs on the scheduler's
thread (``segments`` also on request threads: it touches no torch state).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

import torch

from chattts_service.config import Settings
from chattts_service.domain.speech import (
    TEXT_SAMPLING,
    EngineError,
    NothingToSay,
    SynthesisRequest,
)
from chattts_service.domain.text import pack, speakable, split_sentences
from chattts_service.domain.voices import SpeakerSample
from chattts_service.inference.generation import Heads, Sequence, TextSequence

BASE_STEPS = 150  # headroom of the per-request step cap
SPLITS_KEPT = 32  # texts whose segments are kept (a request asks for them two or three times)
REFINE_MAX_STEPS = 384  # ChatTTS's default for text refinement


class TextNormaliser(Protocol):
    """wetext's normalisation (``domain.text.Normaliser``, or ``normalising``'s process)."""

    def __call__(self, text: str, language: str | None = None) -> str: ...

    def many(self, texts: list[str], language: str | None = None) -> list[str]: ...


class Prompts:
    def __init__(
        self,
        chat,
        heads: Heads,
        max_positions: int,
        settings: Settings,
        text_normaliser: TextNormaliser,
    ):
        self.chat, self.heads, self.max_positions = chat, heads, max_positions
        self.settings = settings
        self.text_normaliser = text_normaliser
        self._prefix_ids: dict[int, torch.Tensor] = {}  # speed -> its prompts' first tokens
        self._splits: OrderedDict[tuple, tuple[list[str], list[tuple[str, int]] | None]]
        self._splits = OrderedDict()
        self._splits_lock = threading.Lock()

    def speaker_embedding(self, seed: int) -> torch.Tensor:
        return voice_for_seed(self.chat.speaker, seed)

    def max_steps_for(self, text: str) -> int:
        """Step cap for a text: speech far longer than its text is a runaway generation."""
        by_length = BASE_STEPS + self.settings.max_steps_per_char * len(text)
        return min(self.settings.max_new_tokens, by_length)

    def normalise(self, text: str, normalize: bool = True, language: str | None = None) -> str:
        """Numbers and symbols written out (``wetext``, when ``normalize``), then ChatTTS's own
        normaliser, both in ``language`` (zh or en; None: detected); raises NothingToSay when
        nothing speakable is left."""
        if normalize:
            text = self.text_normaliser(text, language)
        return self._chattts_normalised(text, language)

    def _chattts_normalised(self, text: str, language: str | None) -> str:
        normalised = self.chat.normalizer(
            text, do_text_normalization=True, do_homophone_replacement=True, lang=language
        )
        if not speakable(normalised):
            raise NothingToSay("text has nothing speakable after normalisation")
        return normalised

    def sentences(self, request: SynthesisRequest) -> list[tuple[str, str]]:
        """Each sentence of the text as written and as the model reads it (normalised one by
        one, so each gets its own language); "" for a sentence with nothing to say
        (punctuation or symbols alone)."""
        sentences = []
        written = split_sentences(request.text)
        # wetext's part for every sentence in one call (another process: see ``normalising``)
        expanded = (
            self.text_normaliser.many(written, request.language) if request.normalize else written
        )
        for sentence, text in zip(written, expanded, strict=True):
            try:
                spoken = self._chattts_normalised(text, request.language)
                sentences.append((sentence, spoken))
            except NothingToSay:
                sentences.append((sentence, ""))
        if not any(spoken for _, spoken in sentences):
            raise NothingToSay("text has nothing speakable after normalisation")
        return sentences

    def segments(self, request: SynthesisRequest) -> list[str]:
        """The request's text as the model will read it (see ``split``)."""
        return self.split(request)[0]

    def input_tokens(self, request: SynthesisRequest) -> int:
        """How many text tokens the model reads for the request (every segment's text)."""
        wrapper = self.chat.tokenizer._tokenizer  # ours, or transformers' (as upstream picks)
        encode = wrapper.encode_plus if hasattr(wrapper, "encode_plus") else wrapper._encode_plus
        return sum(
            encode(text, return_tensors="pt", add_special_tokens=False)["input_ids"].shape[-1]
            for text in self.segments(request)
        )

    def split(self, request: SynthesisRequest) -> tuple[list[str], list[tuple[str, int]] | None]:
        """The segments: normalised sentences packed into segments of at most the configured
        length; with ``sentence_segments``, every sentence its own segment(s), so each one's
        place in the audio is known to the sample, and then also the layout: each sentence as
        written with how many of the segments (in order) speak it.

        The last few texts' answers are kept: a request asks for its segments when it is
        admitted, when it starts and for its usage, and normalising holds the interpreter
        (wetext's search does not let it go), so every time it is done again it stalls the
        scheduler's thread beside it (a 60-sentence text: ~0.16 s of it)."""
        limit = self.settings.max_segment_chars
        key = (request.text, request.normalize, request.language, request.sentence_segments, limit)
        with self._splits_lock:
            kept = self._splits.get(key)
            if kept is not None:
                self._splits.move_to_end(key)
        if kept is None:
            kept = self._split(request)
            with self._splits_lock:
                self._splits[key] = kept
                while len(self._splits) > SPLITS_KEPT:
                    self._splits.popitem(last=False)
        segments, layout = kept
        return list(segments), None if layout is None else list(layout)

    def _split(self, request: SynthesisRequest) -> tuple[list[str], list[tuple[str, int]] | None]:
        sentences = self.sentences(request)
        limit = self.settings.max_segment_chars
        if not request.sentence_segments:
            return pack([spoken for _, spoken in sentences if spoken], limit), None
        pieces = [pack([spoken], limit) if spoken else [] for _, spoken in sentences]
        segments = [piece for group in pieces for piece in group]
        return segments, [(text, len(group)) for (text, _), group in zip(sentences, pieces)]

    def _prompt(self, decorated: str, codes: torch.Tensor | None = None):
        """Token ids and embeddings of a decorated prompt; ``codes`` (a recording's speaker
        prompt, ``[num_vq, frames]``) go after its last token, as upstream's tokenizer puts
        them, and are embedded as audio codes."""
        chat = self.chat
        with torch.inference_mode():
            input_ids, _, text_mask = chat.tokenizer.encode(
                [decorated], chat.config.gpt.num_vq, prompt=codes
            )
            embeddings = chat.embed(input_ids, text_mask)
        return input_ids, embeddings

    def code_sequence(
        self,
        text: str,
        request: SynthesisRequest,
        voice,
        fixed_steps: int | None = None,
        step_cap: int | None = None,
    ) -> Sequence:
        chat = self.chat
        speed = f"[speed_{request.speed}]"
        # upstream's spk_smp and txt_smp (with spk_emb too where the sample has one), or spk_emb
        sample = voice if isinstance(voice, SpeakerSample) else None
        embedding = sample.embedding if sample is not None else voice
        transcript = sample.transcript or None if sample is not None else None
        decorated = chat.speaker.decorate_code_prompts([text], speed, transcript, embedding)[0]
        input_ids, embeddings = self._prompt(decorated, sample.codes if sample else None)
        if embedding is not None:
            with torch.inference_mode():
                chat.speaker.apply(
                    embeddings,
                    embedding,
                    input_ids,
                    chat.tokenizer.spk_emb_ids,
                    torch.device("cpu"),
                )
        room = self.max_positions - embeddings.shape[1]  # the position table bounds it all
        if room < 1:
            raise EngineError(f"text is too long for the model ({embeddings.shape[1]} tokens)")
        max_steps = min(fixed_steps or self.max_steps_for(text), room, step_cap or room)
        # at least one step: a generation that ends at once would be an empty answer
        min_steps = min(fixed_steps or 1, max_steps)
        sequence = Sequence(
            embeddings[0].clone(),
            self.heads,
            request.sampling,
            request.seed,
            max_steps,
            min_steps,
            eos_token=self.heads.num_audio_tokens - 1,
        )
        sequence.shared_prefix = self._shared_prefix(input_ids[0, :, 0], request.speed)
        return sequence

    def _shared_prefix(self, ids: torch.Tensor, speed: int) -> int:
        """How many of a speech prompt's first tokens every prompt of this speed begins with
        (``[Stts][spk_emb][speed_N]``; with the voice's embedding in the second, the same
        positions for every text in that voice): 0 where the prompt does not begin so."""
        if speed not in self._prefix_ids:
            decorated = self.chat.speaker.decorate_code_prompts([""], f"[speed_{speed}]", None, "")
            prefix = decorated[0].removesuffix("[Ptts]")
            ids_of_prefix, _, _ = self.chat.tokenizer.encode([prefix], self.chat.config.gpt.num_vq)
            self._prefix_ids[speed] = ids_of_prefix[0, :, 0]
        prefix = self._prefix_ids[speed]
        count = prefix.shape[0]
        return count if ids.shape[0] > count and torch.equal(ids[:count], prefix) else 0

    def text_sequence(self, text: str, request: SynthesisRequest) -> TextSequence:
        chat = self.chat
        decorated = chat.speaker.decorate_text_prompts([text], request.refine_prompt)[0]
        _, embeddings = self._prompt(decorated)
        return TextSequence(
            embeddings[0].clone(),
            self.heads,
            TEXT_SAMPLING,
            request.seed,
            REFINE_MAX_STEPS,
            0,
            eos_token=chat.tokenizer.eos_token,
        )

    def refined_text(self, finished: TextSequence) -> str:
        tokenizer = self.chat.tokenizer
        ids = finished.result_tokens()[:, 0]
        ids = ids[ids < tokenizer.break_0_ids]
        return tokenizer.decode([ids])[0]


def voice_for_seed(speaker, seed: int) -> torch.Tensor:
    """A reproducible voice from ChatTTS's ``Speaker`` statistics, drawn without touching the
    global RNG (upstream's ``sample_random_speaker`` does)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(speaker.dim, generator=generator, dtype=torch.float32)
    return noise * speaker.std.float() + speaker.mean.float()
