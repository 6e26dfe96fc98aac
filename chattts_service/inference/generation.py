"""Sequences being generated, and the batch that steps them together.

A ``Sequence`` is one request's pass through the GPT: speech codes (four codebooks per step,
kept with their hidden states for the decoder) or refined text (one token per step). Each has
its own sampling parameters and its own random generator.

The ``Batch`` prefills sequences (each into its own KV cache), steps all active ones with one
forward pass, samples every row with ChatTTS's rules (temperature, repetition penalty over the
last 16 tokens, top-p, top-k, as its logits processors do; in one C++ call where the kernels run,
else vectorised over the rows with torch's operators), and drops finished sequences at once, so
a finished sequence stops costing compute and a new one can join between any two steps.

What a request samples never depends on its batch neighbours: every operation here is either
per-row (sorting, softmax, the sampling draws from the row's own generator) or a matrix product
exact per row (the int8 kernels), or run with a fixed number of rows (fp32 heads are evaluated on
``max_rows`` rows, zero-padded, because a CPU GEMM's rounding can change with the row count).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from chattts_service.domain.speech import Sampling
from chattts_service.inference.quantize import KernelLinear, make_linear
from chattts_service.inference.transformer import (
    KVCache,
    PromptFill,
    Transformer,
    rounded_positions,
)

NUM_VQ = 4
REPETITION_WINDOW = 16  # ChatTTS's past_window for its repetition penalty
MIN_TOKENS_TO_KEEP = 3  # what ChatTTS passes to transformers' top-p/top-k warpers
CODEBOOKS = torch.arange(NUM_VQ)  # made once: an index a step would otherwise build per row
HOUSEKEEPING_SECONDS = 30


class Heads:
    """Embeddings and output heads from ChatTTS's ``Embed``, weight norm folded in once.

    The heads are linear layers of the given ``quantization``: int8 heads give each row the
    same logits in any batch by construction; the fp32 ones are always run on exactly ``rows``
    rows (zero-padded), because a CPU GEMM's rounding can change with the row count."""

    def __init__(self, embed, rows: int, quantization: str = "none", kernels=None):
        with torch.no_grad():
            self.code_embeddings = torch.stack(
                [table.weight.detach().float() for table in embed.emb_code]
            )  # [4, 626, D]
            self.text_embeddings = embed.emb_text.weight.detach().float()
            # weight_norm recomputes g * v / |v| on every call upstream; here it is done once
            # int4 is for the GPT's layers: the heads (1% of the weights) stay int8
            quantization = "int8" if quantization == "int4" else quantization
            self.code_head = make_linear(
                torch.cat([head.weight.detach().float() for head in embed.head_code]),
                quantization,
                kernels,
            )
            self.text_head = make_linear(
                embed.head_text.weight.detach().float(), quantization, kernels
            )
        self.num_audio_tokens = self.code_embeddings.shape[1]
        self.kernels = kernels  # the C++ kernels, which also sample (or None: torch samples)
        self.rows = rows
        self.hidden_size = self.code_head.in_features

    def logits(self, hiddens: torch.Tensor, kind: str) -> torch.Tensor:
        """Logits [count, width * vocabulary] for up to ``rows`` hidden states."""
        head = self.code_head if kind == "code" else self.text_head
        if head.rows_independent:
            return head(hiddens)
        count = hiddens.shape[0]
        padded = torch.zeros(self.rows, self.hidden_size)
        padded[:count] = hiddens
        return head(padded)[:count]


class Sequence:
    """One generation: a prompt, sampling parameters, a generator, and what it produced."""

    kind = "code"
    width = NUM_VQ

    def __init__(
        self,
        prompt: torch.Tensor,
        heads: Heads,
        sampling: Sampling,
        seed: int,
        max_steps: int,
        min_steps: int,
        eos_token: int,
    ):
        self.prompt = prompt
        self.heads = heads
        self.sampling = sampling
        self.max_steps = max_steps
        self.min_steps = min_steps
        self.eos_token = eos_token
        self.generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.zeros(max_steps, self.width, dtype=torch.long)
        self.hiddens = torch.empty(max_steps, heads.hidden_size) if self.kind == "code" else None
        self.steps = 0  # tokens accepted (end-of-sequence excluded)
        self.length = 0  # positions held in the KV cache
        self.cache: KVCache | None = None  # its KV cache while it is in a batch
        self.finished = False
        self.filling: PromptFill | None = None  # its prompt's prefill while under way
        self.shared_prefix = 0  # leading prompt positions other prompts begin with too

    @property
    def end_banned(self) -> bool:
        """Fewer than ``min_steps`` tokens so far: end of speech may not be drawn yet."""
        return self.steps < self.min_steps

    def next_embedding(self) -> torch.Tensor:
        last = self.tokens[self.steps - 1]
        return self.heads.code_embeddings[CODEBOOKS, last].sum(0)

    def window(self, vocabulary: int) -> torch.Tensor:
        """The last 16 tokens per codebook [width, 16], padded with ``vocabulary`` (no token)."""
        if self.steps >= REPETITION_WINDOW:  # a full window: a view, no padding to write
            return self.tokens[self.steps - REPETITION_WINDOW : self.steps].T
        padded = torch.full((self.width, REPETITION_WINDOW), vocabulary, dtype=torch.long)
        start = max(0, self.steps - REPETITION_WINDOW)
        count = self.steps - start
        if count:
            padded[:, :count] = self.tokens[start : self.steps].T
        return padded

    def record(self, token: torch.Tensor, hidden: torch.Tensor, ended: bool | None = None) -> None:
        """Keep a step's ``token`` [width] and ``hidden`` state, or finish where the token
        holds end of sequence (``ended``: already known, for a batch checked at once)."""
        if ended is None:
            ended = bool((token == self.eos_token).any())
        if ended:
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
        if self.hiddens is None:
            raise ValueError("a text sequence keeps no hidden states")
        return self.hiddens[: self.steps]

    def kv_positions(self) -> int:
        """The most KV-cache positions this sequence can ever hold (with chunk rounding)."""
        return rounded_positions(self.prompt.shape[0] + self.max_steps)

    def held_positions(self) -> int:
        """The KV-cache positions it holds now (with chunk rounding): a paused sequence's."""
        return rounded_positions(self.length)


class TextSequence(Sequence):
    """Text refinement: one text token per step through ChatTTS's text head."""

    kind = "text"
    width = 1

    def next_embedding(self) -> torch.Tensor:
        return self.heads.text_embeddings[self.tokens[self.steps - 1, 0]]


def _sampling_parameters(sequences: list[Sequence]) -> torch.Tensor:
    """Every row's temperature, repetition penalty and 1 - top_p: [rows, 3] float32, one
    conversion instead of one per parameter."""
    return torch.tensor(
        [
            [s.sampling.temperature, s.sampling.repetition_penalty, 1 - s.sampling.top_p]
            for s in sequences
        ],
        dtype=torch.float32,
    )


def shape_logits(sequences: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """ChatTTS's logits processing per row: [rows, width * vocab] -> [rows, width, vocab]."""
    rows, width = len(sequences), sequences[0].width
    logits = logits.view(rows, width, -1)
    vocabulary = logits.shape[-1]

    parameters = _sampling_parameters(sequences).view(rows, 3, 1, 1)
    temperature, penalty, keep_below = parameters.unbind(1)  # [rows, 1, 1] each
    logits = logits / temperature

    # repetition penalty (ChatTTS's CustomRepetitionPenaltyLogitsProcessorRepeat)
    windows = torch.stack([s.window(vocabulary) for s in sequences])  # [rows, width, 16]
    frequency = torch.zeros(rows, width, vocabulary + 1, dtype=torch.long).scatter_add_(
        2, windows, torch.ones(windows.shape, dtype=torch.long)
    )[..., :vocabulary]
    # penalty ** frequency, looked up from the 17 possible powers (a window holds 16 tokens)
    powers = torch.pow(penalty, torch.arange(REPETITION_WINDOW + 1, dtype=torch.float32))
    alpha = powers.expand(rows, width, -1).gather(-1, frequency)
    logits = torch.where(logits < 0, logits * alpha, logits / alpha)

    # top-p (transformers' TopPLogitsWarper): drop the low tail holding <= 1 - top_p.
    # NumPy's row-wise argsort is ~6x faster than torch.sort on these small rows here.
    order = torch.from_numpy(np.argsort(logits.numpy(), axis=-1))
    ascending = logits.gather(-1, order)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= keep_below
    drop_sorted[..., -MIN_TOKENS_TO_KEEP:] = False
    logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -torch.inf)

    # top-k (transformers' TopKLogitsWarper): keep values >= the k-th largest
    ks = [max(s.sampling.top_k, MIN_TOKENS_TO_KEEP) for s in sequences]
    largest = torch.topk(logits, min(max(ks), vocabulary), dim=-1).values
    kth = largest.gather(
        -1, (torch.tensor(ks).clamp(max=vocabulary) - 1).view(rows, 1, 1).expand(rows, width, 1)
    )
    logits = logits.masked_fill(logits < kth, -torch.inf)

    # no end of sequence before min_steps: one indexed write for all such rows
    early = [(row, s.eos_token) for row, s in enumerate(sequences) if s.end_banned]
    if early:
        early_rows, early_tokens = torch.tensor(early).T
        logits[early_rows[:, None], torch.arange(width), early_tokens[:, None]] = -torch.inf
    return logits


def sample(sequences: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """Draw each row's tokens [rows, width] from its own generator: with the C++ kernels where
    the heads have them (``sample_with_kernels``), else with torch's operators."""
    kernels = sequences[0].heads.kernels
    if kernels is not None:
        return sample_with_kernels(kernels, sequences, logits)
    return sample_with_torch(sequences, logits)


def _uniforms(sequences: list[Sequence]) -> torch.Tensor:
    """One uniform number per codebook from each row's own generator: [rows, width]."""
    return torch.stack(
        [torch.rand(sequence.width, generator=sequence.generator) for sequence in sequences]
    )


def sample_with_kernels(
    kernels, sequences: list[Sequence], logits: torch.Tensor, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """The rules of ``shape_logits`` and the draw of ``sample_with_torch`` in one C++ call
    (``kernels.sample``): the same distribution from the same uniform numbers (``uniforms``
    [rows, width], by default from each row's generator), without a full sort or a dozen
    operators a step."""
    vocabulary = logits.shape[-1] // sequences[0].width
    return kernels.sample(
        logits.float().contiguous(), *kernel_sampling(sequences, vocabulary, uniforms)
    )


def kernel_sampling(
    sequences: list[Sequence], vocabulary: int, uniforms: torch.Tensor | None = None
) -> tuple:
    """``kernels.sample``'s arguments after the logits for these rows: parameters, top-k,
    tokens always kept, repetition windows, the token each forbids, and one uniform number per
    codebook (``uniforms``, by default drawn from each row's generator)."""
    top_k = torch.tensor([s.sampling.top_k for s in sequences], dtype=torch.int64)
    windows = torch.stack([s.window(vocabulary) for s in sequences])
    banned = torch.tensor(
        [s.eos_token if s.end_banned else -1 for s in sequences], dtype=torch.int64
    )
    return (
        _sampling_parameters(sequences),
        top_k,
        MIN_TOKENS_TO_KEEP,
        windows.contiguous(),
        banned,
        _uniforms(sequences) if uniforms is None else uniforms,
    )


def sample_with_torch(sequences: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """Draw each row's tokens [rows, width] from its own generator, with torch's operators.

    Inverse-CDF sampling: one uniform number per codebook from the row's generator, looked up
    in the cumulative probabilities. The same distribution as ``torch.multinomial``, which
    draws an exponential number per vocabulary entry instead (2,504 per row for speech codes)
    and is several times slower for it."""
    probabilities = F.softmax(shape_logits(sequences, logits), dim=-1)
    cumulative = probabilities.cumsum(dim=-1)  # [rows, width, vocab]
    total = cumulative[..., -1:]
    uniform = _uniforms(sequences)[..., None]
    # strictly below the total, so the search never runs past the last token with mass
    target = torch.minimum(uniform * total, total * (1 - 2**-23))
    # the first entry whose cumulative probability exceeds the target: entries with zero
    # probability add nothing to the sum and can never be that entry
    return torch.searchsorted(cumulative, target, right=True)[..., 0]


class Batch:
    """The sequences currently generating, each with its own KV cache."""

    def __init__(self, transformer: Transformer, heads: Heads, max_rows: int, on_empty=None):
        self.transformer = transformer
        self.heads = heads
        self.max_rows = max_rows
        self.active: list[Sequence] = []
        self.filling: list[Sequence] = []  # holding a row while their prompts are prefilled
        self._on_empty = on_empty  # called when the last sequence leaves (memory housekeeping)
        self._last_housekeeping = time.monotonic()

    def __len__(self) -> int:
        return len(self.active)

    @property
    def free_rows(self) -> int:
        return self.max_rows - len(self.active) - len(self.filling)

    def reserved_positions(self) -> int:
        """The KV-cache positions the sequences stepping or being prefilled may come to hold."""
        return sum(sequence.kv_positions() for sequence in (*self.active, *self.filling))

    def _accept(self, sequences: list[Sequence], hiddens: torch.Tensor) -> None:
        for kind in ("code", "text"):
            rows = [i for i, sequence in enumerate(sequences) if sequence.kind == kind]
            if not rows:
                continue
            chosen = [sequences[i] for i in rows]
            logits = self.heads.logits(hiddens[rows], kind)
            tokens = sample(chosen, logits)
            for sequence, token, row in zip(chosen, tokens, rows):
                sequence.record(token, hiddens[row])

    @torch.inference_mode()
    def add(self, sequence: Sequence) -> None:
        """Prefill the prompt and sample the first token; the sequence joins if not finished."""
        self.begin(sequence)
        self.fill(sequence)

    def begin(self, sequence: Sequence) -> None:
        """Give the sequence its KV cache and start its prefill (``fill`` runs it); it holds
        a row from here."""
        if not self.free_rows:
            raise RuntimeError("batch is full")
        cache = self.transformer.new_cache(reserve=sequence.kv_positions())
        sequence.cache = cache
        sequence.filling = PromptFill(
            self.transformer, sequence.prompt, cache, sequence.shared_prefix
        )
        self.filling.append(sequence)

    @torch.inference_mode()
    def fill(self, sequence: Sequence, limit: int | None = None) -> int:
        """Prefill up to ``limit`` more of the sequence's prompt positions (all when None);
        once the whole prompt is in, sample the first token and let the sequence join (unless
        that token ended it: ``finished``). Returns the positions prefilled."""
        filling = sequence.filling
        if filling is None:
            raise RuntimeError("fill: the sequence's prefill has not begun")
        before = filling.done
        hidden = filling.run(limit)
        if hidden is None:
            return filling.done - before
        self.filling.remove(sequence)
        sequence.filling = None
        sequence.length = sequence.prompt.shape[0]
        self._accept([sequence], hidden[None])
        self.active.append(sequence)
        if sequence.finished:
            self.remove([sequence])
        return filling.done - before

    def pause(self, sequence: Sequence) -> None:
        """Take an active sequence out of the steps, keeping its cache and generator: ``resume``
        puts it back where it was (its samples are as if it had never left)."""
        self.active.remove(sequence)

    def resume(self, sequence: Sequence) -> None:
        if not self.free_rows:
            raise RuntimeError("batch is full")
        self.active.append(sequence)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Advance every active sequence by one token; return those that finished."""
        if not self.active:
            return []
        embeddings = self._next_embeddings()
        caches, lengths = [_cache(s) for s in self.active], [s.length for s in self.active]
        head = self._one_call_head()
        if head is None:
            hiddens = self.transformer.step(embeddings, caches, lengths)
            for sequence in self.active:
                sequence.length += 1
            self._accept(self.active, hiddens)
        else:  # the layers, the head and the draw in one C++ call: the same bits
            # (each row's uniform numbers come from its own generator, before or after)
            sampling = kernel_sampling(self.active, head.out_features // NUM_VQ)
            hiddens, tokens = self.transformer.step_and_draw(
                embeddings, caches, lengths, head, sampling
            )
            # which rows drew end of sequence, in one comparison for the batch
            eos = torch.tensor([sequence.eos_token for sequence in self.active])
            ends = (tokens == eos[:, None]).any(dim=1).tolist()
            for sequence, token, hidden, ended in zip(self.active, tokens, hiddens, ends):
                sequence.length += 1
                sequence.record(token, hidden, ended)
        return self.remove([s for s in self.active if s.finished])

    def _next_embeddings(self) -> torch.Tensor:
        """Every active row's input for the next step [rows, hidden]: for speech codes the
        sum of each codebook's embedding of its last token, looked up for all rows at once
        (the same sums, in the same order, as ``Sequence.next_embedding``'s)."""
        active = self.active
        if any(sequence.kind != "code" for sequence in active):
            return torch.stack([sequence.next_embedding() for sequence in active])
        last = torch.stack([sequence.tokens[sequence.steps - 1] for sequence in active])
        table = self.heads.code_embeddings  # [codebooks, vocabulary, hidden]
        flat = (last + CODEBOOKS * table.shape[1]).view(-1)
        rows = table.view(-1, table.shape[2]).index_select(0, flat)
        return rows.view(len(active), NUM_VQ, -1).sum(1)

    def _one_call_head(self):
        """The code head's int8 packing where one C++ call can run the whole step (the
        kernels run every layer and the head, and every row generates speech codes)."""
        head = self.heads.code_head
        if (
            self.transformer.decode_layers is None
            or self.heads.kernels is None
            or not isinstance(head, KernelLinear)
            or head.kernel == "int4"
            or any(sequence.kind != "code" for sequence in self.active)
        ):
            return None
        return head.packing

    def remove(self, leaving: list[Sequence]) -> list[Sequence]:
        """Sequences leave for good (stepping, being prefilled, or paused): their caches go."""
        for sequence in leaving:
            if sequence in self.active:
                self.active.remove(sequence)
            elif sequence in self.filling:
                self.filling.remove(sequence)
            sequence.cache = sequence.filling = None
        if (
            leaving
            and self._on_empty is not None
            and (
                not (self.active or self.filling)
                or time.monotonic() - self._last_housekeeping > HOUSEKEEPING_SECONDS
            )
        ):
            # when the batch empties, and at least every HOUSEKEEPING_SECONDS under steady load
            # (a batch that never empties would otherwise never give freed memory back)
            self._last_housekeeping = time.monotonic()
            self._on_empty()
        return leaving


def _cache(sequence: Sequence) -> KVCache:
    """The KV cache of a sequence in the batch (it has one from ``begin`` on)."""
    if sequence.cache is None:
        raise RuntimeError("a sequence in the batch has no KV cache")
    return sequence.cache
