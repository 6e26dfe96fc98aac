"""CHATTTS_STREAM_LOOKAHEAD: a stream's first chunks decoded with a few steps after them, so its
first audio comes sooner, then exact chunks once its listener holds enough audio; such a
stream's audio is close to the whole answer, not it, and is never cached."""

from __future__ import annotations

import numpy as np
import pytest
import requests
from engines import engine_on, read_streams

from chattts_service.domain.speech import SynthesisRequest
from chattts_service.inference import job

LOOKAHEAD = 3  # the tiny model's decoders read 9 steps either side (ChatTTS's: 52)
SAMPLES_PER_STEP = 512


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """The same model twice: exact streams (the default) and streams with a look-ahead."""
    with (
        engine_on(tiny_model_dir) as exact,
        engine_on(tiny_model_dir, stream_lookahead=LOOKAHEAD) as ahead,
    ):
        yield exact, ahead


def test_a_stream_with_a_lookahead_sends_its_first_chunk_before_the_context_is_generated(
    engines,
):
    """A segment of 12 + LOOKAHEAD + 3 steps: too short for an exact chunk before its end
    (that needs 12 + the decoder's context), so the exact engine sends it in one piece, where
    the look-ahead sends a first chunk of 12 steps while the rest generates."""
    exact, ahead = engines
    steps = job.FIRST_CHUNK_STEPS + LOOKAHEAD + 3
    assert steps < job.FIRST_CHUNK_STEPS + ahead.context_steps
    request = SynthesisRequest("先说一句。", seed=5)
    exact_chunks = list(exact.start(request, fixed_steps=steps, stream=True).chunks(timeout=60))
    run = ahead.start(request, fixed_steps=steps, stream=True)
    chunks = list(run.chunks(timeout=60))
    assert len(exact_chunks) == 1
    assert len(chunks) >= 2 and len(chunks[0]) == job.FIRST_CHUNK_STEPS * SAMPLES_PER_STEP
    assert len(np.concatenate(chunks)) == len(exact_chunks[0])
    assert run.provisional >= job.FIRST_CHUNK_STEPS


def test_a_stream_that_could_not_turn_exact_in_time_starts_exact(engines, monkeypatch):
    """Where the stream's pace could not build the audio exact chunks need within
    PROVISIONAL_MAX_STEPS, it starts as an exact stream does: one piece for the short segment
    above, nothing provisional. (No steps then, and a second to hold for the exact chunk's
    decode: no box can.)"""
    exact, ahead = engines
    monkeypatch.setattr(job, "PROVISIONAL_MAX_STEPS", 0)
    monkeypatch.setattr(job, "CATCH_UP_SECONDS", 1.0)
    steps = job.FIRST_CHUNK_STEPS + LOOKAHEAD + 3
    request = SynthesisRequest("先说一句。", seed=5)
    run = ahead.start(request, fixed_steps=steps, stream=True)
    chunks = list(run.chunks(timeout=60))
    assert len(chunks) == 1 and run.provisional == 0
    exact_chunks = list(exact.start(request, fixed_steps=steps, stream=True).chunks(timeout=60))
    assert np.array_equal(chunks[0], exact_chunks[0])


def test_streams_with_a_lookahead_turn_exact_and_stay_close_before(engines):
    """Two streams at once: each the length of its whole answer, its first steps within a
    small distance of it, and from the step it turned exact on the whole answer's samples
    (within the streamed-equals-whole bound of the other stream tests)."""
    _, ahead = engines
    steps = 300  # 6.4 s of audio, generated far faster than it plays: the stream turns exact
    requests_ = [SynthesisRequest("前面近似，后面精确。", seed=seed) for seed in (21, 22)]
    runs = [ahead.start(request, fixed_steps=steps, stream=True) for request in requests_]
    results = read_streams(runs)
    exact_bound = 1e-3 if ahead.model.decoder.dtype == "fp32" else 0.03
    for request, run, chunks in zip(requests_, runs, results, strict=True):
        whole = ahead.start(request, fixed_steps=steps).result(120).audio
        streamed = np.concatenate(chunks)
        assert len(streamed) == len(whole)
        provisional = run.provisional * SAMPLES_PER_STEP
        assert provisional >= job.JOIN_FIRST_STEPS * SAMPLES_PER_STEP
        assert provisional < len(whole) - ahead.context_steps * SAMPLES_PER_STEP
        head, tail = slice(0, provisional), slice(provisional, None)
        assert np.linalg.norm(streamed[tail] - whole[tail]) <= exact_bound * np.linalg.norm(
            whole[tail]
        )
        assert np.linalg.norm(streamed[head] - whole[head]) <= 0.05 * np.linalg.norm(whole[head])


def test_a_stream_with_a_lookahead_is_not_cached_for_whole_answers(start_server):
    """The whole answer of a request streamed with a look-ahead is generated again (MISS),
    then cached (HIT): the stream's approximate start is never served as it."""
    server = start_server(CHATTTS_STREAM_LOOKAHEAD=str(LOOKAHEAD))
    server.wait_ready()
    # seed 10 makes this text ~100 steps long on the tiny model: a first chunk with look-ahead
    body = {"text": "流式输出的一句比较长的话，测试分块。", "seed": 10, "format": "pcm"}
    url = server.url + "/synthesize"
    with requests.post(url, json={**body, "stream": True}, stream=True, timeout=60) as streamed:
        assert streamed.status_code == 200 and streamed.headers["X-Cache"] == "MISS"
        data = b"".join(streamed.iter_content(chunk_size=None))
    first = requests.post(url, json=body, timeout=60)
    again = requests.post(url, json=body, timeout=60)
    assert first.status_code == 200 and first.headers["X-Cache"] == "MISS"
    assert again.headers["X-Cache"] == "HIT" and again.content == first.content
    assert len(data) == len(first.content)
    # the look-ahead's start counted: at least a first chunk of audio, less than the whole
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    name = "chatts_provisional_audio_seconds_total "
    (line,) = [m for m in metrics.splitlines() if m.startswith(name)]
    provisional = float(line.split()[-1])
    assert provisional >= job.JOIN_FIRST_STEPS * SAMPLES_PER_STEP / 24_000
    assert provisional < float(first.headers["X-Audio-Seconds"])
    assert "Traceback" not in server.log()


def test_a_look_ahead_is_taken_only_at_a_pace_that_can_turn_exact_in_time():
    """The step limit is where a first chunk and PROVISIONAL_MAX_STEPS of provisional audio,
    at the pace slowed by PACE_MARGIN, just build the audio turning exact needs: a step a
    little faster builds more, a little slower less. ChatTTS's decoders (52 steps of context)
    with a look-ahead of 16: steps of up to ~8.5 ms."""
    audio = SAMPLES_PER_STEP / 24_000
    for context, lookahead in ((52, 16), (52, 0), (9, 3)):
        limit = job.look_ahead_step_limit(context, lookahead)
        for step, builds_enough in ((limit * 0.98, True), (limit * 1.02, False)):
            built = job.FIRST_CHUNK_STEPS * audio + job.PROVISIONAL_MAX_STEPS * (
                audio - job.PACE_MARGIN * step
            )
            assert (built >= job.catch_up_seconds(step, context, lookahead)) is builds_enough
    assert 0.0084 < job.look_ahead_step_limit(52, 16) < 0.0086
    assert job.look_ahead_step_limit(52, 32) > job.look_ahead_step_limit(52, 16)
