"""A voice made from a recording is upstream's: the same speaker prompt, the same audio.

Upstream's ``Chat`` and this engine load the same tiny random-weight model. The recording's
speaker prompt must be the string ``Chat.sample_audio_speaker`` makes, and in fp32 without the
kernels a request in that voice must give the waveform upstream's ``_infer_code`` (with
``spk_smp`` and ``txt_smp``) and ``_decode_to_wavs`` give. Random weights leave the top code
logits a coin toss apart, so the code heads' weight-norm gains are scaled up (x500) in this
copy of the model: low-temperature sampling is then the same draw on both sides whatever
their generators (see the facts on comparing with upstream).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from engines import engine_on

from chattts_service.domain.speech import SynthesisRequest
from chattts_service.domain.voices import SpeakerSample, Voice
from chattts_service.inference.sample_encoder import encode_prompt

STEPS = 40
TRANSCRIPT = "hello, this is the recording."


@pytest.fixture(scope="module")
def sharp_model(tiny_model_dir, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    model = tmp_path_factory.mktemp("models") / "sharp"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns(".packed"))
    embed_file = model / "asset" / "Embed.safetensors"
    tensors = load_file(str(embed_file))
    for name in tensors:
        if name.startswith("head_code.") and name.endswith("original0"):
            tensors[name] = tensors[name] * 500.0
    save_file(tensors, str(embed_file))
    return model


@pytest.fixture(scope="module")
def upstream(sharp_model):
    from benchmarks.engine import load_upstream

    return load_upstream(sharp_model)


def _recording(seconds: float = 3.0) -> np.ndarray:
    from benchmarks.engine import voiced_recording

    return voiced_recording(7, seconds)


def _upstream_audio(chat, text: str, prompt: str, seed: int) -> np.ndarray:
    from ChatTTS import Chat

    params = Chat.InferCodeParams(
        spk_smp=prompt,
        txt_smp=TRANSCRIPT,
        temperature=0.01,
        manual_seed=seed,
        min_new_token=STEPS,
        max_new_token=STEPS,
        show_tqdm=False,
    )
    result = next(chat._infer_code([text], False, torch.device("cpu"), True, params))
    return chat._decode_to_wavs(result.hiddens, True)[0]


def test_a_recordings_prompt_and_speech_are_upstreams_in_fp32(sharp_model, upstream):
    with engine_on(sharp_model, quantize="none", kernels="off", decoder_dtype="fp32") as engine:
        recording = _recording()
        codes = engine.encode_sample(recording)
        prompt = encode_prompt(codes)
        assert prompt == upstream.sample_audio_speaker(recording)
        sample = SpeakerSample(codes, TRANSCRIPT)
        voice = Voice("sampled", None, "digest", sample=sample, id="voice_" + "0" * 24)
        for seed, text in ((3, "今天天气很好。"), (4, "the second text is english.")):
            request = SynthesisRequest(text, seed, voice=voice, temperature=0.01)
            (spoken,) = engine.segments(request)
            ours = engine.synthesize(request, fixed_steps=STEPS).audio
            theirs = _upstream_audio(upstream, spoken, prompt, seed)
            assert ours.shape == theirs.shape
            error = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
            assert error < 1e-3, (text, error)
            # the recording is in the prompt: without it (the seed's voice) the audio differs
            plain = engine.synthesize(
                SynthesisRequest(text, seed, temperature=0.01), fixed_steps=STEPS
            ).audio
            assert np.linalg.norm(plain - theirs) / np.linalg.norm(theirs) > 1e-2


def test_a_sampled_voice_batches_with_other_voices_without_changing(sharp_model):
    """The default engine (int8, kernels): a request in a sampled voice gives the same audio
    alone and in a batch beside requests in other voices."""
    with engine_on(sharp_model) as engine:
        codes = engine.encode_sample(_recording(2.0))
        voice = Voice("sampled", None, "d", sample=SpeakerSample(codes, TRANSCRIPT), id="x")
        request = SynthesisRequest("一起生成的句子。", 11, voice=voice)
        alone = engine.synthesize(request, fixed_steps=STEPS).audio
        others = [
            engine.start(SynthesisRequest(f"别的声音{index}。", index), fixed_steps=STEPS)
            for index in range(3)
        ]
        batched = engine.start(request, fixed_steps=STEPS)
        result = batched.result(120)
        for run in others:
            run.result(120)
        assert np.array_equal(alone, result.audio)


def test_long_text_from_its_first_segment_is_upstreams_in_fp32(sharp_model, upstream):
    """CHATTTS_LONG_TEXT_VOICE=first_segment: the first segment alone, its audio encoded as a
    recording, then every segment spoken with that sample, its words and the embedding, as
    ``Chat.infer(split_text=True)`` does; each segment's audio is upstream's."""
    from ChatTTS import Chat

    from chattts_service.domain.embeddings import decode_embedding, encode_embedding

    with engine_on(
        sharp_model,
        quantize="none",
        kernels="off",
        decoder_dtype="fp32",
        long_text_voice="first_segment",
        max_segment_chars=20,
    ) as engine:
        dim = engine.model.chat.speaker.dim
        text_embedding = encode_embedding(
            torch.randn(dim, generator=torch.Generator().manual_seed(5))
        )
        voice = Voice("v", decode_embedding(text_embedding, dim), "d")
        request = SynthesisRequest(
            "The first sentence is here. 第二句话在这里。", 9, voice=voice, temperature=0.01
        )
        segments = engine.segments(request)
        assert len(segments) == 2
        ours = engine.synthesize(request, fixed_steps=STEPS)
        assert "/long-first" in engine.identity  # the cache tells the two modes apart

        def params(**more):
            return Chat.InferCodeParams(
                spk_emb=text_embedding,
                temperature=0.01,
                manual_seed=9,
                min_new_token=STEPS,
                max_new_token=STEPS,
                show_tqdm=False,
                **more,
            )

        device = torch.device("cpu")
        first = next(upstream._infer_code([segments[0]], False, device, True, params()))
        reference = upstream._decode_to_wavs(first.hiddens, True)[0]
        prompt = upstream.sample_audio_speaker(reference)
        start = 0
        for index, segment in enumerate(segments):
            more = {"spk_smp": prompt, "txt_smp": segments[0]}
            result = next(upstream._infer_code([segment], False, device, True, params(**more)))
            theirs = upstream._decode_to_wavs(result.hiddens, True)[0]
            part = ours.audio[start : start + ours.part_samples[index]]
            start += ours.part_samples[index] + ours.pause_samples
            assert part.shape == theirs.shape
            assert np.linalg.norm(part - theirs) / np.linalg.norm(theirs) < 1e-3, index
