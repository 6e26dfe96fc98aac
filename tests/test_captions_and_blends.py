"""Captions timed to the sample, and blended voices: the arithmetic on its own, then over real
HTTP against a server with the tiny model."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import requests
import soundfile
import torch

from chattts_service.domain.voice_store import VoiceStore
from chattts_service.domain.voices import MAX_BLEND_PARTS, UnknownVoice, UnusableBlend, VoiceError
from chattts_service.services.captions import captions, srt, vtt

RATE = 24_000

# -- captions from a layout ---------------------------------------------------------------------


def test_captions_follow_the_segments_and_pauses():
    sentences = [("...", 0), ("Hello there.", 1), ("A long one, cut in two.", 2), ("!!", 0)]
    items = captions(sentences, (100, 200, 300), ("hello there.", "a long one,", "cut."), 50, RATE)
    assert [(c.start_sample, c.end_sample) for c in items] == [(0, 100), (150, 700)]
    # a sentence without audio joins its neighbour: every word the user wrote is captioned
    assert items[0].text == "... Hello there." and items[1].text == "A long one, cut in two. !!"
    assert items[1].spoken_text == "a long one, cut."
    assert items[1].start == round(150 / RATE, 6) and items[1].end == round(700 / RATE, 6)
    with pytest.raises(ValueError):
        captions([("One.", 2)], (10,), ("one",), 0, RATE)


def test_subrip_and_webvtt():
    items = captions(
        [("One.", 1), ("Two <b> & --> three.", 1)], (24_000, 36_012), ("1", "2"), 4_800, RATE
    )
    assert srt(items) == (
        "1\n00:00:00,000 --> 00:00:01,000\nOne.\n\n"
        "2\n00:00:01,200 --> 00:00:02,701\nTwo <b> & --> three.\n"
    )
    assert vtt(items) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nOne.\n\n"
        "00:00:01.200 --> 00:00:02.701\nTwo &lt;b&gt; &amp; --&gt; three.\n"
    )
    long = captions([("Late.", 1)], (RATE * 3725,), ("late",), 0, RATE)
    assert "01:02:05,000" in srt(long)


# -- blends in the voice store ------------------------------------------------------------------

DIM = 16


def _store(tmp_path) -> VoiceStore:
    def sampler(seed: int):
        return torch.randn(DIM, generator=torch.Generator().manual_seed(seed))

    return VoiceStore(tmp_path, DIM, sampler)


def test_a_blend_is_the_normalised_weighted_mean(tmp_path):
    store = _store(tmp_path)
    alloy, echo = store.get("alloy").embedding, store.get("echo").embedding
    blend = store.get("alloy(2)+echo(1)")
    assert torch.allclose(blend.embedding, (2 * alloy + echo) / 3, atol=1e-6)
    assert blend.name == "alloy(0.6667)+echo(0.3333)"
    # order, spelling and scale do not matter: one blend, one cache identity
    for same in ("echo(1)+alloy(2)", "ALLOY(4) + echo(2)", "alloy(1)+echo(1)+alloy(1)"):
        other = store.get(same)
        assert other.digest == blend.digest and torch.equal(other.embedding, blend.embedding)
    assert store.get("alloy(1)+echo(1)").digest != blend.digest
    # seeds blend too, and a part without a weight counts 1
    seeds = store.get("seed:5+seed:6")
    expected = (store.get("seed:5").embedding + store.get("seed:6").embedding) / 2
    assert torch.allclose(seeds.embedding, expected, atol=1e-6)
    # a part weighted 0 is left out
    assert torch.equal(store.get("alloy(1)+echo(0)").embedding, alloy)


def test_blends_that_cannot_be_made(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(UnusableBlend):
        store.get("alloy(0)+echo(0)")
    with pytest.raises(UnknownVoice):
        store.get("alloy(1)+nobody(1)")
    for spec in ("alloy(-1)+echo(1)", "alloy(1e3)", "alloy()+echo", "alloy++echo", "al loy(1)"):
        with pytest.raises(VoiceError, match="blend"):
            store.get(spec)
    with pytest.raises(VoiceError, match="at most"):
        store.get("+".join(["alloy"] * (MAX_BLEND_PARTS + 1)))


def test_a_blend_can_be_registered_under_a_name(tmp_path):
    store = _store(tmp_path)
    store.register("mix", voice="alloy(3)+seed:9(1)")
    blend = store.get("alloy(3)+seed:9(1)")
    stored = store.get("mix")
    # stored as ChatTTS's embedding string: half precision
    assert torch.allclose(stored.embedding, blend.embedding, atol=1e-2)
    with pytest.raises(VoiceError, match="either"):
        store.register("both", "x", voice="alloy")


# -- over HTTP ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(start_server, tmp_path_factory):
    server = start_server(
        CHATTTS_MAX_NEW_TOKENS="120",
        CHATTTS_VOICES_DIR=str(tmp_path_factory.mktemp("voices")),
        CHATTTS_SEGMENT_PAUSE_MS="250",
    )
    server.wait_ready()
    return server


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=180)


def _pcm(payload: bytes) -> np.ndarray:
    return np.frombuffer(payload, dtype="<i2")


def test_captions_hold_each_sentences_audio_to_the_sample(api):
    text = "First, a short one. 第二句话在这里。 And the third sentence!"
    body = {"model": "tts-1", "voice": "nova", "seed": 21, "input": text}
    response = post(api, "/v1/audio/captioned_speech", {**body, "response_format": "wav"})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert response.headers["X-Cache"] == "MISS" and response.headers["X-Segments"] == "3"
    wav = base64.b64decode(answer["audio"])
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    assert rate == RATE and answer["content_type"] == "audio/wav"
    assert abs(answer["seconds"] - len(audio) / RATE) < 1e-6
    items = answer["captions"]
    assert [item["text"] for item in items] == [
        "First, a short one.",
        "第二句话在这里。",
        "And the third sentence!",
    ]
    assert items[0]["start_sample"] == 0 and items[-1]["end_sample"] == len(audio)
    for item in items:
        assert item["start"] == round(item["start_sample"] / RATE, 6)
        # the span is exactly what the sentence gives when it is asked for alone
        alone = post(
            api, "/v1/audio/speech", {**body, "input": item["text"], "response_format": "pcm"}
        )
        assert alone.status_code == 200
        span = audio[item["start_sample"] : item["end_sample"]]
        assert np.array_equal(span, _pcm(alone.content)), item
    # between two captions: the pause the service inserts, silent, 250 ms
    for before, after in zip(items, items[1:]):
        assert after["start_sample"] - before["end_sample"] == RATE // 4
        assert not audio[before["end_sample"] : after["start_sample"]].any()

    again = post(
        api,
        "/v1/audio/captioned_speech",
        {**body, "response_format": "wav", "caption_format": "vtt"},
    )
    assert again.headers["X-Cache"] == "HIT"
    assert again.json()["captions"] == items
    assert again.json()["vtt"].startswith("WEBVTT\n\n00:00:00.000 --> ")
    srt_answer = post(api, "/v1/audio/captioned_speech", {**body, "caption_format": "srt"}).json()
    assert srt_answer["format"] == "mp3" and srt_answer["srt"].count(" --> ") == 3
    assert "vtt" not in srt_answer


def test_captioned_speech_refuses_what_it_cannot_do(api):
    body = {"model": "tts-1", "voice": "nova", "input": "Hi."}
    cases = [
        ({"caption_format": "ass"}, 400, "caption_format"),
        ({"stream": True}, 400, "answered whole"),
        ({"stream_format": "sse"}, 400, "answered whole"),
        ({"captions": True}, 400, "unknown fields"),
    ]
    for extra, status, words in cases:
        response = post(api, "/v1/audio/captioned_speech", {**body, **extra})
        assert response.status_code == status, (extra, response.text)
        assert words in response.json()["error"]["message"]
    nothing = post(api, "/v1/audio/captioned_speech", {**body, "input": "……"})
    assert nothing.status_code == 422


def test_blended_voices_over_http(api):
    import openai

    client = openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=180)
    text = "Blended voices."

    def speech(voice):
        return client.audio.speech.create(
            model="tts-1", voice=voice, input=text, response_format="pcm", extra_body={"seed": 4}
        )

    blend = speech("alloy(2)+echo(1)")
    assert blend.response.headers["X-Cache"] == "MISS"
    assert speech("echo(1)+alloy(2)").response.headers["X-Cache"] == "HIT"
    other = speech("alloy(1)+echo(1)")
    assert other.response.headers["X-Cache"] == "MISS"
    assert other.content != blend.content
    assert speech("alloy").content != blend.content

    registered = post(api, "/v1/audio/voices", {"name": "duet", "voice": "alloy(2)+echo(1)"})
    assert registered.status_code == 201, registered.text
    assert "duet" in requests.get(api.url + "/v1/audio/voices", timeout=10).json()["voices"]
    assert len(speech("duet").content) > 0
    assert len(speech("duet(1)+seed:3(1)").content) > 0

    zero = post(api, "/v1/audio/speech", {"model": "tts-1", "voice": "alloy(0)", "input": text})
    assert zero.status_code == 422 and "weight" in zero.json()["error"]["message"]
    unknown = post(
        api, "/v1/audio/speech", {"model": "tts-1", "voice": "alloy+ghost", "input": text}
    )
    assert unknown.status_code == 400 and "ghost" in unknown.json()["error"]["message"]
