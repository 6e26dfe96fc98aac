"""The engine in-process, on the tiny random-weight model through ChatTTS's real classes."""

import threading

import numpy as np
import pytest
import torch

from chattts_service.config import Settings
from chattts_service.engine import SAMPLE_RATE, Engine, NothingToSay, SynthesisRequest


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = Engine(Settings.from_env({}, model_dir=tiny_model_dir, verify_model=False,
                                      max_new_tokens=200, threads=1))
    engine.load()
    return engine


def test_audio_has_the_shape_the_steps_imply(engine):
    result = engine.synthesize(SynthesisRequest("你好，欢迎。", seed=3))
    assert result.sample_rate == SAMPLE_RATE
    assert result.audio.dtype == np.float32 and result.audio.ndim == 1
    assert 1 <= result.steps <= 200
    # one GPT step is 2 mel frames of hop 256; the centred inverse STFT yields (frames - 1) hops
    assert len(result.audio) == (2 * result.steps - 1) * 256
    assert np.abs(result.audio).max() <= 1.0
    assert np.abs(result.audio).max() > 0


def test_same_request_same_audio_other_seed_other_audio(engine):
    first = engine.synthesize(SynthesisRequest("今天天气很好", seed=11))
    again = engine.synthesize(SynthesisRequest("今天天气很好", seed=11))
    other = engine.synthesize(SynthesisRequest("今天天气很好", seed=12))
    assert np.array_equal(first.audio, again.audio)
    assert first.audio.shape != other.audio.shape or not np.array_equal(first.audio, other.audio)


def test_voice_from_a_seed_leaves_the_global_rng_alone(engine):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    voice_a = engine.speaker_embedding(42)
    after = torch.rand(3)
    assert torch.equal(expected, after)
    assert torch.equal(voice_a, engine.speaker_embedding(42))
    assert not torch.equal(voice_a, engine.speaker_embedding(43))


def test_requests_do_not_leak_parameters_into_each_other(engine):
    # upstream infer() leaves spk_smp/txt_smp set on shared defaults; ours builds fresh ones
    alone = engine.synthesize(SynthesisRequest("第二句话", seed=8))
    engine.synthesize(SynthesisRequest("第一句话。第二句。", seed=9, refine_text=True))
    after = engine.synthesize(SynthesisRequest("第二句话", seed=8))
    assert np.array_equal(alone.audio, after.audio)
    assert engine._chat.InferCodeParams().spk_smp is None


def test_text_refinement_runs_and_is_deterministic(engine):
    first = engine.synthesize(SynthesisRequest("你好世界", seed=2, refine_text=True))
    again = engine.synthesize(SynthesisRequest("你好世界", seed=2, refine_text=True))
    assert first.steps >= 1
    assert np.array_equal(first.audio, again.audio)


def test_text_with_nothing_speakable_is_refused(engine):
    # ChatTTS's own normaliser deletes digits and symbols
    with pytest.raises(NothingToSay):
        engine.synthesize(SynthesisRequest("1+1=2", seed=1))


def test_concurrent_callers_get_the_same_audio_as_sequential_ones(engine):
    texts = [("一二三", 1), ("你好", 2), ("hello there", 3), ("再见", 4)]
    sequential = {t: engine.synthesize(SynthesisRequest(t, s)).audio for t, s in texts}
    results = {}

    def call(text, seed):
        results[text] = engine.synthesize(SynthesisRequest(text, seed)).audio

    threads = [threading.Thread(target=call, args=item) for item in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert set(results) == set(sequential)
    for text in results:
        assert np.array_equal(results[text], sequential[text]), text


def test_warm_up_runs_the_whole_pipeline(engine):
    assert engine.warm_up() > 0
