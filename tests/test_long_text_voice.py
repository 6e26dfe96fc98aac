"""A long text keeps one voice from its first segment to its last, on the full-size model.

The model here has random weights, so how a voice *sounds* cannot be judged; what makes a voice
is, and is checked exactly: every segment's prompt carries the same speaker vector in the same
place, every segment samples from the request's seed, and every segment's audio in the long
answer is bit for bit what that segment gives when asked for alone. Nothing carries over from
one segment to the next, so the tenth segment is in the same voice as the first.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engines import engine_on

from chattts_service.domain.speech import SynthesisRequest

STEPS = 24  # every segment generates exactly this many steps: the test's time is bounded
TEXT = (
    "The first sentence opens the story. 第二句话接着讲下去。 A third one follows, longer than "
    "the others, so that the packing has something to do. 第四句话在这里。 The fifth sentence "
    "is here too. 第六句是最后一句，也是最长的一句，它让文本再分出一个段落来。 And the seventh "
    "closes it."
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from chattts_service.tools.testmodel import build

    model_dir = build(tmp_path_factory.mktemp("models") / "full", size="full", seed=0)
    # an fp32 decoder decodes each answer alone; a bf16 one decodes answers that end together
    # as one batch, which rounds apart from a batch of one (docs/benchmarks.md): the voice is
    # what is checked bit for bit here, not that rounding
    with engine_on(model_dir, threads=2, decoder_dtype="fp32") as engine:
        yield engine


@pytest.mark.parametrize("voice_name", ["onyx", "seed:77", "alloy(1)+nova(2)"])
def test_every_segment_of_a_long_text_has_the_same_voice(engine, voice_name):
    voice = engine.voices.get(voice_name)
    request = SynthesisRequest(TEXT, seed=5, voice=voice)
    segments = engine.segments(request)
    assert len(segments) >= 3, segments

    # 1. the same speaker vector, in the same place of every segment's prompt
    rows = []
    for text in segments:
        sequence = engine.prompts.code_sequence(text, request, voice.embedding, fixed_steps=STEPS)
        tokens = engine.model.chat.tokenizer
        decorated = engine.model.chat.speaker.decorate_code_prompts(
            [text], f"[speed_{request.speed}]", None, voice.embedding
        )[0]
        input_ids, _ = engine.prompts._prompt(decorated)
        places = (input_ids[0, :, 0] == tokens.spk_emb_ids).nonzero().flatten()
        assert len(places) == 1
        rows.append(sequence.prompt[places[0]].clone())
        # 2. each samples from the request's seed
        assert sequence.generator.initial_seed() == request.seed
    expected = torch.nn.functional.normalize(voice.embedding, p=2.0, dim=0, eps=1e-12)
    for row in rows:
        assert torch.equal(row, rows[0])
        assert torch.allclose(row, expected.to(row.dtype), atol=1e-6)

    # 3. each segment of the long answer is bit for bit that segment made alone: the sentences
    # it packs, sent as a request of their own
    whole = engine.start(request, fixed_steps=STEPS).result(timeout=600)
    assert whole.segments == len(segments) and whole.part_samples
    offset = 0
    for index, (text, samples) in enumerate(
        zip(_sentences_of(engine, request), whole.part_samples)
    ):
        offset += whole.pause_samples if index else 0
        alone_request = SynthesisRequest(text, seed=5, voice=voice)
        assert engine.segments(alone_request) == [segments[index]]
        alone = engine.synthesize(alone_request, fixed_steps=STEPS)
        assert np.array_equal(whole.audio[offset : offset + samples], alone.audio), index
        offset += samples
    assert offset == len(whole.audio)


def _sentences_of(engine, request) -> list[str]:
    """For each segment of the request, the sentences (as written) it packs."""
    from chattts_service.domain.text import pack

    sentences = engine.prompts.sentences(request)
    limit = engine.settings.max_segment_chars
    groups, first = [], 0
    for segment in engine.segments(request):
        last = first + 1
        while pack([spoken for _, spoken in sentences[first:last] if spoken], limit) != [segment]:
            last += 1
            assert last <= len(sentences), segment
        groups.append(" ".join(text for text, _ in sentences[first:last]))
        first = last
    return groups
