"""Sequences being generated, and the batch that steps them together.

A ``Sequence`` is one request's pass through the GPT: speech codes (four codebooks per step,
kept with their hidden states for the decoder) or refined text (one token per step). Each has
its own sampling parameters and its own random generator, so what it samples does not depend on
which other sequences share the batch. Sampling reuses ChatTTS's own logits processors
(temperature, repetition penalty over the last 16 tokens, top-p, top-k) on that row alone.

The ``Batch`` prefills sequences into free KV-cache slots, steps all active ones with one forward
pass, and drops finished ones at once (the last active slot moves into the hole), so a finished
sequence stops costing compute and a new one can join between any two steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .transformer import Transformer

NUM_VQ = 4
REPETITION_WINDOW = 16  # ChatTTS's past_window for its repetition penalty


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float


CODE_SAMPLING = Sampling(temperature=0.3, top_p=0.7, top_k=20, repetition_penalty=1.05)
TEXT_SAMPLING = Sampling(temperature=0.7, top_p=0.7, top_k=20, repetition_penalty=1.0)


class Heads:
    """Embeddings and output heads from ChatTTS's ``Embed``, weight norm folded in once."""

    def __init__(self, embed):
        with torch.no_grad():
            self.code_embeddings = torch.stack(
                [table.weight.detach().float() for table in embed.emb_code])  # [4, 626, D]
            self.text_embeddings = embed.emb_text.weight.detach().float()
            # weight_norm recomputes g * v / |v| on every call upstream; here it is done once
            self.code_head = torch.cat([head.weight.detach().float() for head in embed.head_code])
            self.text_head = embed.head_text.weight.detach().float().contiguous()
        self.num_audio_tokens = self.code_embeddings.shape[1]


class Sequence:
    """One generation: a prompt, sampling parameters, a generator, and what it produced."""

    kind = "code"

    def __init__(self, prompt: torch.Tensor, heads: Heads, sampling: Sampling, seed: int,
                 max_steps: int, min_steps: int, eos_token: int):
        from ChatTTS.model.processors import gen_logits

        self.prompt = prompt
        self.heads = heads
        self.max_steps = max_steps
        self.min_steps = min_steps
        self.eos_token = eos_token
        self.generator = torch.Generator().manual_seed(seed)
        self.temperature = sampling.temperature
        vocabulary = self._vocabulary_size()
        warpers, processors = gen_logits(num_code=vocabulary, top_P=sampling.top_p,
                                         top_K=sampling.top_k,
                                         repetition_penalty=sampling.repetition_penalty)
        self.processors = [*processors, *warpers]  # the order ChatTTS applies them in
        self.tokens = torch.zeros(max_steps, self._width(), dtype=torch.long)
        self.hiddens = torch.empty(max_steps, heads.code_head.shape[1]) if self.kind == "code" else None
        self.steps = 0          # tokens accepted (end-of-sequence excluded)
        self.length = 0         # positions held in the KV cache
        self.finished = False
        self.cancelled = False
        self.job = None         # set by the scheduler

    def _width(self) -> int:
        return NUM_VQ

    def _vocabulary_size(self) -> int:
        return self.heads.num_audio_tokens

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.heads.code_head.T).view(NUM_VQ, -1)

    def next_embedding(self) -> torch.Tensor:
        last = self.tokens[self.steps - 1]
        return self.heads.code_embeddings[torch.arange(NUM_VQ), last].sum(0)

    def accept(self, hidden: torch.Tensor) -> None:
        """Sample the next token from ``hidden`` (the GPT output for the latest position)."""
        logits = self._logits(hidden[None]).float() / self.temperature
        start = max(0, self.steps - REPETITION_WINDOW)
        window = self.tokens[start:self.steps].T  # [width, <=16]
        for processor in self.processors:
            logits = processor(window, logits)
        if self.steps < self.min_steps:
            logits[:, self.eos_token] = -torch.inf
        probabilities = F.softmax(logits, dim=-1)
        token = torch.multinomial(probabilities, 1, generator=self.generator)[:, 0]
        if bool((token == self.eos_token).any()):
            self.finished = True
            return
        self.tokens[self.steps] = token
        if self.hiddens is not None:
            self.hiddens[self.steps] = hidden
        self.steps += 1
        if self.steps >= self.max_steps:
            self.finished = True

    def result_tokens(self) -> torch.Tensor:
        return self.tokens[: self.steps]

    def result_hiddens(self) -> torch.Tensor:
        return self.hiddens[: self.steps]

    def kv_positions(self) -> int:
        """The most KV-cache positions this sequence can ever hold."""
        return self.prompt.shape[0] + self.max_steps


class TextSequence(Sequence):
    """Text refinement: one text token per step through ChatTTS's text head."""

    kind = "text"

    def _width(self) -> int:
        return 1

    def _vocabulary_size(self) -> int:
        return self.heads.text_head.shape[0]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.heads.text_head.T

    def next_embedding(self) -> torch.Tensor:
        return self.heads.text_embeddings[self.tokens[self.steps - 1, 0]]


class Batch:
    """The sequences currently generating; sequence ``i`` lives in KV-cache slot ``i``."""

    def __init__(self, transformer: Transformer, max_rows: int):
        self.transformer = transformer
        self.max_rows = max_rows
        self.active: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.active)

    @property
    def free_rows(self) -> int:
        return self.max_rows - len(self.active)

    def reserved_positions(self) -> int:
        return sum(sequence.kv_positions() for sequence in self.active)

    @torch.inference_mode()
    def add(self, sequence: Sequence) -> None:
        """Prefill the prompt and sample the first token; the sequence joins if not finished."""
        if not self.free_rows:
            raise RuntimeError("batch is full")
        slot = len(self.active)
        hidden = self.transformer.prefill(sequence.prompt, slot)
        sequence.length = sequence.prompt.shape[0]
        sequence.accept(hidden)
        if not sequence.finished:
            self.active.append(sequence)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Advance every active sequence by one token; return those that finished."""
        if not self.active:
            return []
        embeddings = torch.stack([sequence.next_embedding() for sequence in self.active])
        lengths = torch.tensor([sequence.length for sequence in self.active])
        hiddens = self.transformer.step(embeddings, lengths)
        for sequence, hidden in zip(self.active, hiddens):
            sequence.length += 1
            sequence.accept(hidden)
        return self.remove([s for s in self.active if s.finished or s.cancelled])

    def remove(self, leaving: list[Sequence]) -> list[Sequence]:
        for sequence in leaving:
            index = self.active.index(sequence)
            last = len(self.active) - 1
            if index != last:
                moved = self.active[last]
                self.transformer.cache.move(last, index, moved.length)
                self.active[index] = moved
            self.active.pop()
        if not self.active:
            self.transformer.cache.release()
        return leaving
